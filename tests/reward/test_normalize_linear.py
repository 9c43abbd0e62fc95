"""Answer normalisation in linear time, with the same results as DAPO's regular expressions.

The oracle below is DAPO's `normalize_final_answer` (verl `math_dapo.py`) as its regular expressions
write it, quadratic in a line's length; the rewrite must give the same string on every input: random
strings built from the characters and commands the rules react to, and every AIME-2024 / DAPO answer."""

from __future__ import annotations

import json
import random
import re
import time

import pytest

from dataset_files import DATA, needs_data
from dsv4rl.reward.graders import get_grader
from dsv4rl.reward.normalize import (
    _REMOVED,
    _SUBSTITUTIONS,
    MAX_ANSWER_CHARS,
    last_boxed,
    normalize_final_answer,
)


def reference_normalize(text: str) -> str:
    """DAPO's rule, regular expressions and all (the substitution lists are the same tuples)."""
    text = text.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        text = text.replace(before, after)
    for expr in _REMOVED:
        text = text.replace(expr, "")
    text = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", text)
    text = re.sub(r"(\\text\{)(.*?)(\})", "\\2", text)
    text = re.sub(r"(\\textbf\{)(.*?)(\})", "\\2", text)
    text = re.sub(r"(\\overline\{)(.*?)(\})", "\\2", text)
    text = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", text)
    text = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", text)
    text = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def reference_last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start
    while i < len(text):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if text[i] == "}" and depth == 0:
            return text[start + len("\\boxed{") : i]
        i += 1
    return None


ATOMS = (
    "$", "$", "{", "}", "}", "\n", "\\text{", "\\textbf{", "\\overline{", "\\boxed{", "frac", "sqrt", "=",
    " ", ",", "1", "2", "a", "x", "\\", "an ", "a ", ".$", "\\$", "dollars", "\\text{}", "^\\circ", "{,}",
    "\\frac12", "mbox", "\\text{m}", "\\dfrac{3}{4}", "(", ")", "\\pi", "\\!", "\\;",
)  # fmt: skip


def test_same_results_as_dapos_regular_expressions_on_random_strings() -> None:
    rng = random.Random(20260522)
    for _ in range(30_000):
        text = "".join(rng.choice(ATOMS) for _ in range(rng.randint(0, 16)))
        assert normalize_final_answer(text) == reference_normalize(text), repr(text)
        assert last_boxed(text) == reference_last_boxed(text), repr(text)


@pytest.mark.parametrize(
    "text",
    [
        "$1$ and $2$\n$3$ x $4$", "\\text{a}\\text{b\n}c}", "\\boxed{1}}\n\\boxed{2}", "\\boxed{\n1}",
        "$", "$$", "\\text{", "\\boxed{}", "\\textbf{\\text{x}}", "x = \\boxed{\\frac{1}{2}}",
        "\\overline{12}\\overline{3", "\\fracab", "\\sqrt2", "1,000", "a \\text{ and } b",
    ],
)  # fmt: skip
def test_same_results_on_hand_made_cases(text: str) -> None:
    assert normalize_final_answer(text) == reference_normalize(text)


@needs_data
def test_same_results_on_every_aime_and_dapo_answer() -> None:
    aime = [json.loads(line)["answer"] for line in (DATA / "aime24.jsonl").read_text().splitlines()]
    dapo = [
        json.loads(line)["reward_model"]["ground_truth"]
        for line in (DATA / "dapo_math_17k_sample300.jsonl").read_text().splitlines()
    ]
    for answer in aime + dapo:
        for text in (answer, f"${answer}$", f"\\boxed{{{answer}}}", f"x = \\text{{{answer}}} units"):
            assert normalize_final_answer(text) == reference_normalize(text), text


def reference_dapo_reward(response: str, ground_truth: str) -> bool:
    """DAPO's `compute_score` (Minerva criterion): the last 300 characters, the last "Answer:" line."""
    matches = re.findall(r"(?i)Answer\s*:\s*([^\n]+)", response[-300:])
    prediction = reference_normalize(matches[-1] if matches else "[INVALID]")
    return prediction == reference_normalize(ground_truth)


def dapo_cases(answers: list[str]) -> list[tuple[str, str]]:
    cases = []
    for a in answers:
        cases += [
            (f"Let me think.\nAnswer: {a}", a), (f"Answer: ${a}$", a), (f"answer:\\boxed{{{a}}}", a),
            (f"Answer: x = {a}", a), (f"Answer: {a}1", a), (f"The answer is {a}", a),
            (f"Answer: {a}\n" + "pad " * 80, a), (f"Answer: {a} dollars.", a), (f"Answer: \\text{{{a}}}", a),
            (f"Answer: 1\nAnswer: {a}", a), (f"Answer: {a}\nAnswer: 1", a),
        ]  # fmt: skip
    return cases


HAND_MADE = [
    "34",
    "1000",
    "1,000",
    "-3",
    "\\frac{1}{2}",
    "\\frac12",
    "\\sqrt{2}",
    "90^\\circ",
    "(3, \\pi)",
    "x^2+1",
]


def test_the_dapo_grader_agrees_with_dapos_reward() -> None:
    grader = get_grader("dapo")
    rng = random.Random(7)
    cases = dapo_cases(HAND_MADE)
    for _ in range(3000):  # random text around an "Answer:" line
        noise = "".join(rng.choice(ATOMS) for _ in range(rng.randint(0, 12)))
        cases.append((f"{noise}\nAnswer: {noise[-6:]}", rng.choice(HAND_MADE + [noise[-6:]])))
    outcomes = set()
    for response, truth in cases:
        reward = grader.grade(response, truth)
        assert reward == float(reference_dapo_reward(response, truth)), response
        outcomes.add(reward)
    assert outcomes == {0.0, 1.0}


@needs_data
def test_the_dapo_grader_agrees_with_dapos_reward_on_aime_and_dapo_answers() -> None:
    aime = [json.loads(line)["answer"] for line in (DATA / "aime24.jsonl").read_text().splitlines()]
    dapo = [
        json.loads(line)["reward_model"]["ground_truth"]
        for line in (DATA / "dapo_math_17k_sample300.jsonl").read_text().splitlines()
    ]
    grader = get_grader("dapo")
    right = 0
    for response, truth in dapo_cases(aime + dapo):
        reward = grader.grade(response, truth)
        assert reward == float(reference_dapo_reward(response, truth)), response
        right += reward == 1.0
    assert right >= 330 * 5  # "Answer: a", "$a$", "\\boxed{a}", "x = a", the last of two lines, ...


@pytest.mark.parametrize(
    "text",
    [
        "Answer: $x" + "\\text{a" * 16_000,  # one "$", unclosed \text{: the reference rescans the line
        "\\boxed{" * 15_000,
        "$1" + "2" * 100_000,
    ],
    ids=["unclosed-text", "unclosed-boxed", "one-dollar"],
)
def test_grader_timeout_normalization_is_linear(text: str) -> None:
    """The inputs that take DAPO's expressions seconds to minutes take milliseconds; the bound is far
    from both (a loaded 2-core machine normalises 100 k characters in well under 0.1 s)."""
    start = time.perf_counter()
    normalize_final_answer(text)
    seconds = time.perf_counter() - start
    print(f"normalize_final_answer, {len(text)} characters: {seconds * 1000:.1f} ms")
    assert seconds < 1.0


def test_an_answer_longer_than_the_cap_is_no_answer() -> None:
    grader = get_grader("answer_line")
    long_answer = "1" * (MAX_ANSWER_CHARS + 1)
    assert grader.final_answer(f"Answer: {long_answer}") is None
    assert grader.grade(f"Answer: {long_answer}", long_answer) == 0.0
    at_cap = "1" * MAX_ANSWER_CHARS
    assert grader.grade(f"Answer: {at_cap}", at_cap) == 1.0
    assert get_grader("boxed").final_answer(f"\\boxed{{{long_answer}}}") is None
