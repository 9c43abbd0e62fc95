"""The eval graders on every AIME-2024 answer and the 300 DAPO sample answers, plus tricky forms."""

from __future__ import annotations

import json

import pytest

from dataset_files import DATA, needs_data
from dsv4rl.reward.graders import get_grader


def answers() -> list[str]:
    aime = [json.loads(line)["answer"] for line in (DATA / "aime24.jsonl").read_text().splitlines()]
    dapo = [
        json.loads(line)["reward_model"]["ground_truth"]
        for line in (DATA / "dapo_math_17k_sample300.jsonl").read_text().splitlines()
    ]
    assert (len(aime), len(dapo)) == (30, 300)
    return aime + dapo


@pytest.fixture(scope="module")
def math_verify():
    grader = get_grader("math_verify", num_workers=2)
    yield grader
    grader.close()


@needs_data
def test_every_answer_is_read_in_each_format_and_a_wrong_one_is_not(math_verify) -> None:
    golds = answers()
    wrong = [str(int(a) + 1) if a.lstrip("-").isdigit() else a + "1" for a in golds]
    line = [f"Some reasoning.\nAnswer: {a}" for a in golds]
    boxed = [f"so the result is \\boxed{{{a}}}." for a in golds]
    answer_line, boxed_grader = get_grader("answer_line"), get_grader("boxed")
    assert [answer_line.grade(r, a) for r, a in zip(line, golds, strict=True)] == [1.0] * len(golds)
    assert [boxed_grader.grade(r, a) for r, a in zip(boxed, golds, strict=True)] == [1.0] * len(golds)
    assert math_verify.grade_many(boxed, golds) == [1.0] * len(golds)
    assert math_verify.grade_many(line, golds) == [1.0] * len(golds)
    wrong_boxed = [f"\\boxed{{{w}}}" for w in wrong]
    assert math_verify.grade_many(wrong_boxed, golds) == [0.0] * len(golds)
    assert [answer_line.grade(f"Answer: {w}", a) for w, a in zip(wrong, golds, strict=True)] == [0.0] * len(
        golds
    )
    assert [answer_line.final_answer(r) for r in line] == golds  # maj@n votes on these


@pytest.mark.parametrize(
    ("response", "gold", "by_answer_line", "by_boxed", "by_math_verify"),
    [
        ("Answer: $\\boxed{204}$", "204", 1.0, 1.0, 1.0),
        ("Answer: 1,000", "1000", 1.0, 0.0, 1.0),  # thousands separator: the rule strips it
        ("\\boxed{\\frac{1}{2}}", "0.5", 0.0, 0.0, 1.0),  # equal values, different forms: math-verify only
        ("The answer is \\boxed{070}", "70", 0.0, 0.0, 1.0),  # AIME's zero padding
        ("Answer: 204.", "204", 0.0, 0.0, 1.0),  # a trailing period
        ("\\boxed{33}\nAnswer: 34", "34", 1.0, 0.0, 0.0),  # math-verify reads the box first
        ("no answer stated", "5", 0.0, 0.0, 0.0),
    ],
)
def test_tricky_forms(math_verify, response, gold, by_answer_line, by_boxed, by_math_verify) -> None:
    assert get_grader("answer_line").grade(response, gold) == by_answer_line
    assert get_grader("boxed").grade(response, gold) == by_boxed
    assert math_verify.grade(response, gold) == by_math_verify
