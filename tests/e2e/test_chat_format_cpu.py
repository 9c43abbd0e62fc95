"""The tiny loop in DeepSeek-V4's chat format (`data.chat_format=deepseek_v4`), as a user runs it: prompts
rendered by deepseek-recipe with the tiny tokenizer's chat tokens, responses split into reasoning and
answer, the split in metrics.jsonl and in the periodic eval.

Thinking stays off for the tiny model (its prompt ends with `</think>`): it answers in one token, so it
learns as in the plain format. With thinking on, one new token cannot close the thinking block and answer:
the second run checks that such responses are counted (`no_answer_fraction`) and graded incorrect.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_runs import train

from dsv4rl.metrics import read_metrics

pytestmark = pytest.mark.slow

STEPS = 20  # the recipe evaluates every 20 steps


def test_tiny_loop_in_the_deepseek_v4_format(tmp_path: Path) -> None:
    train(
        tmp_path / "run", "data.chat_format=deepseek_v4", f"train.steps={STEPS}", "train.checkpoint_every=0"
    )
    metrics = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [line["step"] for line in metrics] == list(range(1, STEPS + 1))
    assert all(line["no_answer_fraction"] == 0.0 and line["reasoning_len_mean"] == 0.0 for line in metrics)
    assert all(0.0 < line["answer_len_mean"] <= 1.0 for line in metrics)
    rewards = [line["reward_mean"] for line in metrics]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5, rewards  # it learns
    (evaluated,) = [line for line in metrics if "eval/pass@1" in line]
    assert evaluated["eval/no_answer_fraction"] == 0.0 and evaluated["step"] == STEPS


def test_unclosed_thinking_is_counted_and_graded_incorrect(tmp_path: Path) -> None:
    # effort low: no "Reasoning Effort" preamble (483 tokens of the character tokenizer, over max_prompt_len)
    overrides = ("data.chat_format=deepseek_v4", "data.thinking=true", "data.reasoning_effort=low")
    train(tmp_path / "run", *overrides, "eval=none", "train.steps=2", "train.checkpoint_every=0")
    for line in read_metrics(tmp_path / "run" / "metrics.jsonl"):
        # one token: </think> (an empty answer) or anything else (no answer); both are graded incorrect
        assert line["no_answer_fraction"] > 0.5 and line["answer_len_mean"] == 0.0
        assert line["reasoning_len_mean"] <= 1.0 and line["reward_mean"] == 0.0
