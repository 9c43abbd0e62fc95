"""String-level answer extraction and normalisation shared by the rule graders.

`normalize_final_answer` follows the Minerva rules (Lewkowycz et al. 2022, appendix D), which DAPO's
grader (verl `math_dapo.py`) applies to both the extracted answer and the ground truth before an
exact string comparison: keep the right-hand side of any "=", drop units and filler words and
spacing, unwrap \\text{}/\\textbf{}/\\overline{}/\\boxed{}, expand \\fracab / \\sqrta shorthand, drop
"$", and remove thousands separators from plain integers.
"""

from __future__ import annotations

import re

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
_UNWRAP = [
    re.compile(r"\\text\{(.*?)\}"),
    re.compile(r"\\textbf\{(.*?)\}"),
    re.compile(r"\\overline\{(.*?)\}"),
]
_BOXED_GREEDY = re.compile(r"\\boxed\{(.*)\}")
_FIRST_MATH = re.compile(r"(.*?)(\$)(.*?)(\$)(.*)")
_FRAC_SHORT = re.compile(r"(frac)([^{])(.)")
_SQRT_SHORT = re.compile(r"(sqrt)([^{])")

ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


def normalize_final_answer(text: str) -> str:
    """Minerva normalisation of a final answer string (see module docstring)."""
    text = text.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        text = text.replace(before, after)
    for expr in _REMOVED:
        text = text.replace(expr, "")
    text = _FIRST_MATH.sub(r"$\3$", text)  # keep only the first $...$ span
    for pattern in _UNWRAP:
        text = pattern.sub(r"\1", text)
    text = _BOXED_GREEDY.sub(r"\1", text)
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
    i = start + len("\\boxed{")
    depth = 1
    while i < len(text):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + len("\\boxed{") : i]
        i += 1
    return None
