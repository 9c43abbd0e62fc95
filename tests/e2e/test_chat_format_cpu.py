"""The tiny loop in DeepSeek-V4's chat format (`data.chat_format=deepseek_v4`), as a user runs it: prompts
rendered by deepseek-recipe with the tiny tokenizer's chat tokens, responses split into reasoning and
answer, the split in metrics.jsonl and in the periodic eval.

Thinking stays off for the tiny model (its prompt ends with `</think>`): it answers in one token, so it
learns as in the plain format. With thinking on, one new token cannot close the thinking block and answer:
the second run checks that such responses are counted (`no_answer_fraction`) and graded incorrect. The
third runs DeepSeek-V4.1's format (`deepseek_v41`) through the same loop.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from cli_runs import train

from dsv4rl.config.choices import ChatFormat
from dsv4rl.config.model_schema import ModelConfig
from dsv4rl.data.chat_format import ChatSettings, PromptRenderer
from dsv4rl.metrics import read_metrics
from dsv4rl.model.tokenizer import run_tokenizer
from dsv4rl.report.rollouts import rollouts_file

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


def test_a_run_in_the_deepseek_v41_format_sends_v41s_prompts(tmp_path: Path) -> None:
    """`data.chat_format=deepseek_v41` with an integer budget, the tiny model on `arith_chars_v41` (one id
    more: V4.1's <｜System｜>): the model directory carries that tokenizer, the engine generates from the ids
    dsv4rl renders (a system turn holding "Reasoning Effort: 40 ..."), and the responses are parsed by the
    V4.1 parser (one token: no closed thinking, graded incorrect, as with V4)."""
    run = tmp_path / "run"
    # the effort line makes a 99-token prompt: the indexer keeps every compressed entry of it and a new token
    overrides = ("data.chat_format=deepseek_v41", "model.tokenizer=arith_chars_v41", "data.thinking=true",
                 "data.reasoning_budget=40", "data.max_prompt_len=100", "model.tiny.index_topk=26",
                 "algo.prompts_per_step=8", "algo.group_size=4")  # fmt: skip  # wiring: a small batch
    train(run, *overrides, "eval=none", "train.steps=2", "train.checkpoint_every=0", "run.save_rollouts=1")
    tokenizer = run_tokenizer(replace(ModelConfig(), path=str(run / "model")))
    assert tokenizer.convert_tokens_to_ids("<｜System｜>") == 31 and len(tokenizer) == 32
    renderer = PromptRenderer(tokenizer, ChatSettings(ChatFormat.deepseek_v41, True, reasoning_budget=40))
    records = [json.loads(line) for line in rollouts_file(run, 2).read_text().splitlines()]
    for record in records:
        assert record["prompt_ids"] == renderer.encode([record["prompt"]])[0]
        assert record["prompt_ids"][:2] == [tokenizer.bos_token_id, 31]
    assert "Reasoning Effort: 40 (range 1-100" in renderer.render(records[0]["prompt"])
    for line in read_metrics(run / "metrics.jsonl"):
        assert line["no_answer_fraction"] > 0.5 and line["reward_mean"] == 0.0
