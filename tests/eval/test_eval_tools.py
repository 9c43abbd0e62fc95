"""Eval with the recipe's tools (`rollout.mode=tools`): trajectories on the engines, the last turn graded,
tool calls and finish reasons in the report; a single-turn recipe's report keeps its keys.

A scripted engine stands in for the tiny model (an untrained model seldom calls): on a first turn it
alternates between calling the tool ("?") and guessing "5"; after a tool result ("=<digit>") it copies
the digit. So half the samples call once and are right, the others are right only when the digit is 5.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from dsv4rl.config.compose import compose
from dsv4rl.data.arith import tiny_tool_problems
from dsv4rl.eval.periodic import eval_metrics
from dsv4rl.eval.run import eval_grader, evaluate_on_engines
from dsv4rl.eval.view import render_eval
from dsv4rl.model.tokenizer import run_tokenizer

SAMPLES = 4
# What a single-turn eval report held before tools existed: it must not change (`scored_by`, which says
# the eval set's grader scored it, came with the recipe-scored eval)
SINGLE_TURN_KEYS = {
    "pass@1", "pass@2", "pass@4", "avg@4", "maj@4", "truncation_ratio", "response_len_mean", "problems",
    "samples_per_problem", "eval", "dataset", "grader", "scored_by", "sampling", "seconds", "grading",
    "chat_format", "thinking", "engines", "unknown_ids", "missing", "per_problem",
}  # fmt: skip


class ScriptedEngine:
    """An `EngineAPI` whose /generate follows the script of the module doc, one token per turn."""

    def __init__(self, tokenizer) -> None:  # noqa: ANN001
        self.tokenizer = tokenizer
        self.first_turns = 0
        self.calls = 0
        self.asked: list[dict] = []
        self.base_url = "scripted"

    def _token(self, text: str) -> int:
        return self.tokenizer.encode(text, add_special_tokens=False)[0]

    def _next(self, ids: list[int]) -> int:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if "=" in text and not text.endswith("="):  # a tool result was inserted (not arith's "a+b="): copy it
            return self._token(text[text.rindex("=") + 1])
        self.first_turns += 1
        return self._token("?" if self.first_turns % 2 else "5")

    async def generate(self, input_ids, sampling_params, return_logprob=False, **asks):  # noqa: ANN001, ANN201
        self.calls += 1
        self.asked.append(asks)
        batch = input_ids if isinstance(input_ids[0], list) else [input_ids]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(batch)
        outs = []
        for ids, one in zip(batch, params, strict=True):
            for _ in range(one.get("n", 1)):  # single turn: a prompt's n samples from one request
                token = self._next(ids)
                meta = {
                    "finish_reason": {"type": "length", "length": 1},
                    "output_token_logprobs": [[-0.25, token, None]],
                    "weight_version": "scripted",
                }
                outs.append({"output_ids": [token], "meta_info": meta})
        return outs if isinstance(input_ids[0], list) or len(outs) > 1 else outs[0]


def run_eval(recipe: str, tmp_path: Path, problems=None):  # noqa: ANN001, ANN201
    cfg = compose(recipe, ["eval=tiny_arith", f"eval.samples_per_problem={SAMPLES}", f"run.dir={tmp_path}"])
    tokenizer = run_tokenizer(cfg.model)
    engine = ScriptedEngine(tokenizer)
    if problems is None:
        from dsv4rl.eval.data import eval_problems

        problems = eval_problems(cfg)[:6]
    grader = eval_grader(cfg)
    loop = asyncio.new_event_loop()
    try:
        report = evaluate_on_engines(cfg, problems, [engine], tokenizer, grader, loop, seed=None)
    finally:
        loop.close()
        grader.close()
    return cfg, report, engine


def test_a_tools_recipe_is_evaluated_with_its_tool(tmp_path: Path) -> None:
    problems = tiny_tool_problems(9, seed=0, rows=12)
    cfg, report, engine = run_eval("tiny_tool", tmp_path, problems)
    n = len(problems) * SAMPLES
    assert report["rollout_mode"] == "tools" and report["samples_per_problem"] == SAMPLES
    assert report["calls_per_problem"] == pytest.approx(0.5)  # every other sample called `lookup` once
    assert report["turns_mean"] == pytest.approx(1.5)
    assert report["tool_errors_mean"] == 0 and report["parse_errors_mean"] == 0
    # every turn is cut by its 1-token cap; the fractions of all reasons sum to one
    assert report["finish/length"] == 1.0
    assert sum(report[f"finish/{r}"] for r in ("stop", "length", "max_turns", "tool_budget", "abort")) == 1
    # the graded text is the last turn's: the callers copied the digit, the guessers said 5
    fives = sum(p.answer == "5" for p in problems) * SAMPLES // 2
    assert report["avg@4"] == pytest.approx((n // 2 + fives) / n)
    assert report["response_len_mean"] == pytest.approx((4 + 1) / 2)  # "?", "=d" inserted, "d" vs. "5"
    assert report["generated_len_mean"] == pytest.approx(1.5) and report["masked_token_fraction"] > 0
    assert all(asks == {} for asks in engine.asked)  # no routing replay asked for in an eval
    metrics = eval_metrics(report, [1, 4])
    assert metrics["eval/calls_per_problem"] == pytest.approx(0.5)
    assert metrics["eval/finish/length"] == 1.0
    from rich.console import Console

    console = Console(record=True, width=120)
    render_eval(report, console)
    text = console.export_text()
    assert "mean tool calls per sample" in text and "length 100%" in text


def test_a_single_turn_report_is_unchanged(tmp_path: Path) -> None:
    """tiny_arith (rollout.mode single_turn): one /generate per engine, the report's keys as before."""
    _, report, engine = run_eval("tiny_arith", tmp_path)
    assert set(report) == SINGLE_TURN_KEYS
    assert engine.calls == 1 and report["response_len_mean"] == 1.0
    assert not any(key.startswith("eval/finish") or "calls" in key for key in eval_metrics(report, [1, 4]))


def test_dapo_math_tir_evaluates_with_the_python_tool_in_dsml() -> None:
    """`dsv4rl eval aime24 recipe=dapo_math_tir`'s runner: DeepSeek-V4's DSML turns with the python tool,
    the eval's sampling (aime24's T 0.8, top-p 0.7) and chat settings, no routing replay asked for even
    where training asks for it."""
    from dsv4rl.eval.tools import eval_multi_turn
    from dsv4rl.rollout.turn_format import DsmlFormat

    cfg = compose("dapo_math_tir", ["eval=aime24", "algo.routing_replay=true"])
    multi = eval_multi_turn(cfg, run_tokenizer(cfg.model))
    assert multi is not None and isinstance(multi.runner.format, DsmlFormat)
    assert [t.name for t in multi.tools] == ["python"] and multi.renderer.settings.thinking
    assert multi.runner.sampling == cfg.eval.sampling and multi.runner.sampling.top_p == 0.7
    assert multi.runner.choices.generate_kwargs() == {} and cfg.algo.routing_replay
    assert eval_multi_turn(compose("dapo_math", ["eval=aime24"]), run_tokenizer(cfg.model)) is None
