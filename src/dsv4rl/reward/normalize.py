"""String-level answer extraction and normalisation shared by the rule graders.

`normalize_final_answer` follows the Minerva rules (Lewkowycz et al. 2022, appendix D), which DAPO's
grader (verl `math_dapo.py`) applies to both the extracted answer and the ground truth before an
exact string comparison: keep the right-hand side of any "=", drop units and filler words and
spacing, unwrap \\text{}/\\textbf{}/\\overline{}/\\boxed{}, expand \\fracab / \\sqrta shorthand, drop
"$", and remove thousands separators from plain integers.

It runs in time linear in the text's length. The reference writes three of its rules as regular
expressions (keep the first $...$ span; unwrap \\text{...}, \\textbf{...}, \\overline{...} up to the
first "}"; unwrap \\boxed{...} up to the last "}") whose failed attempts rescan the rest of the line
from every start position: quadratic, seconds for a 16 k-character answer and minutes at 100 k
(docs/faults.md). Here each rule is one scan per line giving the same string (`.` in those patterns
stops at "\\n", so every match lies within a line; tests/reward/test_normalize_linear.py compares the
two on random strings). The graders also read no answer longer than `MAX_ANSWER_CHARS` (it is no
answer: graded incorrect), as DAPO reads only a response's last 300 characters.
"""

from __future__ import annotations

import re
from collections.abc import Callable

_SUBSTITUTIONS = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
_REMOVED = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
    "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
    "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
    ",\\!", "{,}", '"', "\\dots",
)  # fmt: skip
_UNWRAP = ("\\text{", "\\textbf{", "\\overline{")
_FRAC_SHORT = re.compile(r"(frac)([^{])(.)")  # one attempt per "frac": already linear
_SQRT_SHORT = re.compile(r"(sqrt)([^{])")

# The longest answer a grader reads; MATH-500's longest is 159 characters, AIME's and DAPO-Math's are
# integers. A longer one (a policy that writes a whole derivation on its "Answer:" line) is no answer.
MAX_ANSWER_CHARS = 1000

ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")  # linear: an attempt per "answer"
_BRACES = re.compile(r"[{}]")


def _first_math_span(line: str) -> str:
    """re.sub(r"(.*?)(\\$)(.*?)(\\$)(.*)", r"$\\3$", line) for a line without "\\n": a match starts at
    the line's start (where else could it, when there it fails?) and takes the whole line."""
    first = line.find("$")
    second = line.find("$", first + 1) if first >= 0 else -1
    return line if second < 0 else f"${line[first + 1 : second]}$"


def _unwrap_lazy(line: str, opening: str) -> str:
    """re.sub(re.escape(opening) + r"(.*?)\\}", r"\\1", line): each opening up to the first "}" after it;
    once an opening has no "}" after it, none after it has either."""
    out, at = [], 0
    while (start := line.find(opening, at)) >= 0:
        end = line.find("}", start + len(opening))
        if end < 0:
            break
        out += (line[at:start], line[start + len(opening) : end])
        at = end + 1
    out.append(line[at:])
    return "".join(out)


def _unbox_greedy(line: str) -> str:
    """re.sub(r"\\\\boxed\\{(.*)\\}", r"\\1", line): the first \\boxed{ up to the line's last "}" (after
    which no "}" is left for a second match)."""
    start = line.find("\\boxed{")
    end = line.rfind("}")
    if start < 0 or end < start + len("\\boxed{"):
        return line
    return line[:start] + line[start + len("\\boxed{") : end] + line[end + 1 :]


def _by_line(text: str, rule: Callable[[str], str]) -> str:
    return "\n".join(rule(line) for line in text.split("\n")) if "\n" in text else rule(text)


def normalize_final_answer(text: str) -> str:
    """Minerva normalisation of a final answer string (see module docstring), in linear time."""
    text = text.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        text = text.replace(before, after)
    for expr in _REMOVED:
        text = text.replace(expr, "")
    text = _by_line(text, _first_math_span)  # keep only the first $...$ span of a line
    for opening in _UNWRAP:
        text = _by_line(text, lambda line, opening=opening: _unwrap_lazy(line, opening))
    text = _by_line(text, _unbox_greedy)
    text = _FRAC_SHORT.sub(r"frac{\2}{\3}", text)
    text = _SQRT_SHORT.sub(r"sqrt{\2}", text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def last_answer_line(text: str) -> str | None:
    """The text after the last "Answer:" (case-insensitive) up to the end of that line, or None."""
    matches = ANSWER_LINE.findall(text)
    return matches[-1] if matches else None


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} with balanced braces; None if absent or unclosed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 1
    for brace in _BRACES.finditer(text, start + len("\\boxed{")):
        depth += 1 if brace.group() == "{" else -1
        if depth == 0:
            return text[start + len("\\boxed{") : brace.start()]
    return None
