"""Graders read a thinking response's answer part only: the reasoning's own "Answer:" lines never count,
and a response whose thinking never closed has no answer (incorrect, and no grader call)."""

from __future__ import annotations

import pytest

from dsv4rl.config.choices import ChatFormat
from dsv4rl.data.chat_format import ChatSettings, PromptRenderer
from dsv4rl.data.chat_response import ResponseParser
from dsv4rl.model.tokenizer import deepseek_v4_tokenizer
from dsv4rl.reward.graders import get_grader, grade_responses


@pytest.fixture(scope="module")
def parser() -> ResponseParser:
    tokenizer = deepseek_v4_tokenizer()
    return ResponseParser(PromptRenderer(tokenizer, ChatSettings(ChatFormat.deepseek_v4, thinking=True)))


def answer(parser: ResponseParser, text: str) -> str | None:
    tokenizer = parser.renderer.tokenizer
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return parser.parse(ids, text).answer


@pytest.mark.parametrize("name", ["dapo", "answer_line", "boxed"])
def test_the_grader_reads_the_answer_part_only(parser: ResponseParser, name: str) -> None:
    grader = get_grader(name, correct=1.0, incorrect=-1.0)
    wrong_in_reasoning = "Maybe Answer: 5 and \\boxed{5}? No.</think>The sum is \\boxed{7}.\nAnswer: 7"
    right_in_reasoning = (
        "So Answer: 7 and \\boxed{7}. Let me write it.</think>The sum is \\boxed{5}.\nAnswer: 5"
    )
    unclosed = "Let me check once more.\n\\boxed{7}\nAnswer: 7"  # cut off before </think>
    texts = [answer(parser, t) for t in (wrong_in_reasoning, right_in_reasoning, unclosed)]
    assert texts[2] is None
    graded = grade_responses(grader, texts, ["7", "7", "7"], answers=True)
    assert graded.rewards == [1.0, -1.0, -1.0]
    assert graded.answers == ["7", "5", None]
    # the whole text (chat_format none) would have read the reasoning's answer in the unclosed response
    assert grade_responses(grader, [unclosed], ["7"]).rewards == [1.0]


def test_no_answer_skips_the_grader_call() -> None:
    class Counting:
        name, correct, incorrect = "counting", 1.0, 0.0
        calls = 0

        def grade(self, response: str, ground_truth: str) -> float:
            Counting.calls += 1
            return 1.0

        def final_answer(self, response: str) -> str | None:
            return response

    graded = grade_responses(Counting(), [None, "x", None], ["1", "1", "1"], answers=True)
    assert (graded.rewards, graded.answers, Counting.calls) == ([0.0, 1.0, 0.0], [None, "x", None], 1)
    assert grade_responses(Counting(), [None, None], ["1", "1"]).rewards == [0.0, 0.0]


def test_a_pooled_grader_with_no_answers() -> None:
    grader = get_grader("dapo", pooled=True)
    try:
        graded = grade_responses(grader, [None, "Answer: 3"], ["3", "3"], answers=True)
        assert graded.rewards == [0.0, 1.0] and graded.answers == [None, "3"]
    finally:
        grader.close()
