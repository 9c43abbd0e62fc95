"""Graders that cannot stall a step: long responses, calls that time out or hang, exceptions counted by type,
and the run stopped when too many of a batch's calls raise (issue 22, point 3)."""

from __future__ import annotations

import asyncio
import logging
import pickle
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from grader_rules import RaisingRule, SlowRule
from rich.console import Console

from dsv4rl.checks.validate import validate
from dsv4rl.config.choices import RewardOnError
from dsv4rl.config.compose import ConfigError, compose
from dsv4rl.config.schema import EvalConfig, RewardConfig
from dsv4rl.data.problems import Problem
from dsv4rl.eval.periodic import eval_metrics
from dsv4rl.eval.run import eval_grader, evaluate_responses
from dsv4rl.eval.view import render_eval
from dsv4rl.metrics import StepTimer
from dsv4rl.reward.graders import (
    GraderError,
    PooledGrader,
    get_grader,
    grade_responses,
)
from dsv4rl.reward.math_verify import MathVerifyGrader, verify_answer
from dsv4rl.reward.results import FnSpec, RewardError
from dsv4rl.reward.rewarder import RewardSet
from dsv4rl.reward.scorers import BuiltinScorer
from dsv4rl.samples import Sample
from dsv4rl.train import rewarding
from dsv4rl.train.loop import RLLoop

BOUND_S = 6.0  # the acceptance: a 100 k-character response graded (or timed out) in under 6 s
SIZE = 100_000


def long_responses(size: int = SIZE) -> dict[str, str]:
    """What long responses look like to the extractors: one long "Answer:" line, one long \\boxed{...},
    and LaTeX-like text with a single "$" and unclosed \\text{ (DAPO's expressions rescan those)."""
    return {
        "answer_line": ("Let me think.\nAnswer: " + "12+" * size)[:size],
        "boxed": ("So \\boxed{" + "1+" * size)[: size - 2] + "}.",
        "latex": ("Answer: $x" + "\\text{a" * size)[:size],
        "prose": ("Let me think step by step. " * (size // 27 + 1))[: size - 12] + "\nAnswer: 12",
    }


@pytest.mark.parametrize("name", ["arith", "dapo", "answer_line", "boxed", "math_verify"])
def test_grader_timeout_a_100k_response_every_grader(name: str) -> None:
    """Each grader, as training runs it (in this process; math_verify in its pool) and as eval runs it
    (every grader in a pool, final answers too): one 100 k-character response of each shape in < 6 s."""
    ways = {"train": get_grader(name), "eval": get_grader(name, pooled=True)}
    try:
        for way, grader in ways.items():
            grade_responses(grader, ["Answer: 1"], ["1"], answers=True)  # pools start before the clock
            for shape, text in long_responses().items():
                start = time.perf_counter()
                graded = grade_responses(grader, [text], ["12"], answers=True)
                seconds = time.perf_counter() - start
                print(f"{name:<12} {way:<6} {shape:<12} {len(text)} chars: {seconds:.3f} s", flush=True)
                assert seconds < BOUND_S, (name, way, shape, seconds)
                assert graded.errors == 0
    finally:
        for grader in ways.values():
            getattr(grader, "close", lambda: None)()


def test_grader_timeout_a_slow_call_is_graded_incorrect_and_counted(caplog) -> None:
    grader = PooledGrader(SlowRule(), timeout_s=0.5)
    try:
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="dsv4rl.reward.fn_pool"):
            graded = grade_responses(grader, ["slow", "7", "slow"], ["7", "7", "7"], answers=True)
        assert time.monotonic() - start < 30
        assert graded.rewards == [-1.0, 1.0, -1.0]
        assert graded.answers == [None, "7", None]
        assert (graded.timeouts, graded.errors) == (2, 0)
        # the worker's alarm stops them (no restart), unless a loaded machine misses the chunk's deadline
        assert graded.counts() == {
            "grader_timeouts": 2,
            "grader_errors": 0,
            "grader_restarts": graded.restarts,
        }
        assert any("grader slow call took over 0.5 s" in r.getMessage() for r in caplog.records)
    finally:
        grader.close()


def test_grader_timeout_a_call_that_ignores_the_alarm_is_killed_and_the_restart_counted() -> None:
    grader = PooledGrader(SlowRule(blocked=True), timeout_s=0.5, num_workers=2)
    try:
        start = time.monotonic()
        graded = grade_responses(grader, ["7", "slow", "8"], ["7", "7", "8"])
        assert time.monotonic() - start < 60
        assert graded.rewards == [1.0, -1.0, 1.0]
        assert graded.timeouts == 1 and graded.restarts >= 1
        assert grade_responses(grader, ["7"], ["7"]).rewards == [1.0]  # the fresh pool works
    finally:
        grader.close()


def test_grader_timeout_in_the_eval_report_and_the_periodic_eval_metrics(tmp_path: Path) -> None:
    problems = [Problem("p", "7", "a"), Problem("q", "8", "b")]
    responses = tmp_path / "responses.jsonl"
    responses.write_text('{"id": "a", "responses": ["7", "slow"]}\n{"id": "b", "responses": ["8", "8"]}\n')
    grader = PooledGrader(SlowRule(), timeout_s=0.5)
    try:
        report = evaluate_responses(EvalConfig(grader="arith"), problems, responses, grader)
    finally:
        grader.close()
    assert report["grading"] == {"timeouts": 1, "errors": 0, "error_types": {}, "restarts": 0}
    assert report["pass@1"] == pytest.approx(0.75)
    assert report["per_problem"][0]["majority_answer"] == "7"  # the timed-out sample states none
    metrics = eval_metrics(report, [1])
    assert (metrics["eval_grader_timeouts"], metrics["eval_grader_errors"]) == (1, 0)
    console = Console(record=True, width=200)
    render_eval(report, console)
    assert "grading: 1 response(s) timed out, 0 raised, 0 pool restart(s)" in console.export_text()


def test_grader_errors_are_counted_by_type_and_logged(caplog) -> None:
    responses = ["bad"] + ["7"] * 39  # 1 of 40: under the default 5 %
    with caplog.at_level(logging.WARNING, logger="dsv4rl.reward.graders"):
        graded = grade_responses(RaisingRule(), responses, ["7"] * 40, answers=True)
    assert graded.rewards == [0.0] + [1.0] * 39 and graded.answers[0] is None
    assert (graded.errors, graded.error_types) == (1, {"ValueError": 1})
    assert graded.summary()["error_types"] == {"ValueError": 1}
    assert any("1 of 40 calls raised (ValueError x1)" in r.getMessage() for r in caplog.records)


def test_too_many_grader_errors_stop_with_the_exception() -> None:
    responses = ["bad", "7", "bad", "7", "7", "bad", "7", "7", "7", "7"]
    with pytest.raises(
        GraderError, match=r"grader raising: 3 of 10 calls raised \(30%.*max_error_fraction=0.05"
    ) as info:
        grade_responses(RaisingRule(), responses, ["7"] * 10)
    assert "ValueError: cannot grade this" in str(info.value)
    assert isinstance(info.value.__cause__, ValueError)  # in this process: the exception itself
    # the fraction is the recipe's: 30 % passes a 0.5 limit, and 0 stops at the first error
    assert grade_responses(RaisingRule(), responses, ["7"] * 10, max_error_fraction=0.5).errors == 3
    with pytest.raises(GraderError, match="1 of 40 calls raised"):
        grade_responses(RaisingRule(), ["bad"] + ["7"] * 39, ["7"] * 40, max_error_fraction=0.0)


def test_a_math_verify_api_change_stops_the_run_instead_of_zeroing_rewards() -> None:
    """What a changed math-verify signature looks like from a pool worker: every call raises TypeError."""
    rule = RaisingRule(TypeError, "parse() got an unexpected keyword argument 'parsing_timeout'", always=True)
    grader = PooledGrader(rule, timeout_s=5.0)
    try:
        with pytest.raises(
            GraderError, match=r"4 of 4 calls raised \(100%.*TypeError: parse\(\) got"
        ) as info:
            grade_responses(grader, ["1", "2", "3", "4"], ["1"] * 4)
        assert "Traceback" in str(info.value) and "in grade" in str(info.value)  # the worker's
    finally:
        grader.close()


def test_verify_answer_lets_math_verify_exceptions_through(monkeypatch) -> None:
    import math_verify

    def changed_parse(*args, **kwargs):
        raise TypeError("parse() got an unexpected keyword argument 'parsing_timeout'")

    monkeypatch.setattr(math_verify, "parse", changed_parse)
    with pytest.raises(TypeError, match="parsing_timeout"):
        verify_answer("\\boxed{1}", "1")


def test_reward_pool_keys_reach_the_graders_and_are_validated() -> None:
    cfg = compose(
        "tiny_arith", ["reward.num_workers=3", "reward.timeout_s=2.5", "reward.max_error_fraction=0.2"]
    )
    assert (cfg.reward.num_workers, cfg.reward.max_error_fraction) == (3, 0.2)
    pooled = eval_grader(cfg)
    assert isinstance(pooled, PooledGrader) and (pooled.num_workers, pooled.timeout_s) == (3, 2.5)
    assert pooled.name == "arith" and pooled.grade("7", "7") == 1.0
    pooled.close()
    math_verify = get_grader("math_verify", reward=cfg.reward)
    assert (math_verify.num_workers, math_verify.timeout_s) == (3, 2.5)
    copy = pickle.loads(pickle.dumps(pooled))  # a copy starts its own workers
    assert (copy.num_workers, copy.rule) == (3, pooled.rule)
    cfg.reward.num_workers, cfg.reward.max_error_fraction = 0, 1.5
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert any("reward.num_workers must be >= 1 (got 0)" in p for p in info.value.problems)
    assert any("reward.max_error_fraction must be in [0, 1] (got 1.5)" in p for p in info.value.problems)
    assert RewardConfig().max_error_fraction == 0.05 and RewardConfig().num_workers == 1


def test_math_verify_reads_the_tail_of_a_response() -> None:
    grader = MathVerifyGrader(timeout_s=5.0)
    try:
        padding = "Let me double-check. " * 300  # 6,300 characters after the answer
        assert grader.grade_many(["\\boxed{12}", "\\boxed{12}\n" + padding], ["12", "12"]) == [1.0, 0.0]
        assert grader.rule.final_answer("\\boxed{12}\n" + padding) is None
        assert MathVerifyGrader(tail_chars=0).rule.final_answer("\\boxed{12}\n" + padding) == "12"
    finally:
        grader.close()


def _loop_with(texts: list[str], answer: str = "7") -> RLLoop:
    """An RLLoop with only what collect_batch reads: one group of `texts`, which the fake engines
    (`driver.live_clients()`, handed to the patched generate_samples) return, scored by a grader that
    raises."""
    cfg = compose("tiny_arith", [f"algo.group_size={len(texts)}", "run.save_rollouts=0"])
    cfg.algo.dynamic_sampling.enabled = False
    loop = RLLoop.__new__(RLLoop)
    loop.cfg = cfg
    loop.backend = SimpleNamespace(data_parallel_size=1)
    spec = FnSpec("raising", "builtin:raising", 1.0, RewardOnError.zero, 5.0)
    samples = [Sample(0, [1, 2], [3], [-0.5], text, "stop", answer=answer) for text in texts]
    loop.driver = SimpleNamespace(
        stream=SimpleNamespace(next_batch=lambda: [Problem("1+6=", answer, "a")]),
        rewards=RewardSet([BuiltinScorer(spec, RaisingRule())], None, cfg.reward.max_error_fraction),
        tokenizer=SimpleNamespace(pad_token_id=0),
        live_clients=lambda: samples,  # every engine answers: no roster, nothing rerouted
        roster=None,
        event_loop=asyncio.new_event_loop(),
        renderer=None,  # data.chat_format=none: prompts as they are, responses graded whole
        parser=None,
        multi_turn=None,  # rollout.mode=single_turn
    )
    return loop


async def _samples_from_clients(clients, *args, on_group=None, **kwargs) -> list[Sample]:
    samples = list(clients)
    on_group(0, samples)
    return samples


def test_the_training_step_records_grader_counts_and_stops_on_too_many_errors(monkeypatch) -> None:
    monkeypatch.setattr(rewarding, "generate_samples", _samples_from_clients)
    fine, broken = _loop_with(["7", "bad", "7", "8"]), _loop_with(["bad", "bad", "7", "8"])
    try:
        fine.driver.rewards.max_error_fraction = 0.5
        _, metrics = fine.collect_batch(1, StepTimer(), background=True)
        assert metrics["grader_errors"] == 1 and metrics["grader_timeouts"] == 0
        assert metrics["reward/raising/errors"] == 1 and metrics["reward/raising/score"] == pytest.approx(0.5)
        assert metrics["grader_restarts"] == 0 and metrics["reward_mean"] == pytest.approx(0.5)
        with pytest.raises(RewardError, match=r"2 of 4 calls this step failed \(50%"):
            broken.collect_batch(1, StepTimer(), background=True)
    finally:
        for loop in (fine, broken):
            loop.driver.event_loop.close()
