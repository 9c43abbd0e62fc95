"""A tool's own failures (it raised, or ran past the rollout's timeout_s) and an environment's step that
raised: counted per tool, logged with their traceback (rate-limited), carried by the call's record, bounded
by rollout.max_tool_error_fraction; the model's own errors (ToolResult(error=True), a malformed call) are
not. Trajectories run on the tiny character tokenizer against the scripted engine of test_trajectory."""

from __future__ import annotations

import asyncio
import logging
import re

import pytest
from test_trajectory import (
    CALL,
    EOS,
    PROBLEM,
    TOK,
    LookupLike,
    ScriptedEngine,
    call_then_answer,
    make_runner,
    run,
)

from dsv4rl.config.choices import RolloutMode
from dsv4rl.config.schema import RolloutConfig, SamplingConfig
from dsv4rl.data.problems import Problem
from dsv4rl.rollout.env import EnvReset, EnvStep, UserEnv
from dsv4rl.rollout.tool_failures import FailureLog, StepFailures, ToolFailure, ToolFailureError
from dsv4rl.rollout.trajectory import TrajectoryRunner, trajectory_metrics
from dsv4rl.rollout.turn_format import PLAIN_RESULT, PlainFormat
from dsv4rl.samples import Trajectory
from dsv4rl.tools.base import ToolResult
from dsv4rl.train.rollout_records import rollout_records

LOGGER = "dsv4rl.rollout.tool_failures"


def failing_on(calls: set[int], error: Exception | None = None):  # noqa: ANN201
    """A tool behaviour that raises `error` on the given call numbers (0-based) and answers "7" otherwise."""
    seen = []

    async def behavior(args):
        seen.append(args)
        if len(seen) - 1 in calls:
            raise error or RuntimeError("the lookup service is down")
        return ToolResult(text="7")

    return behavior


def raise_boom(message: str = "boom"):  # noqa: ANN201
    def deep() -> None:
        raise RuntimeError(message)

    async def behavior(args):
        deep()

    return behavior


def problems(n: int) -> list[Problem]:
    return [Problem("Q:", "7", f"p{i}") for i in range(n)]


# --- what counts --------------------------------------------------------------------------------------------


def test_a_raising_tool_is_counted_recorded_and_answered_shortly():
    tool = LookupLike(behavior=failing_on({1, 3}))
    samples = run(make_runner([tool], max_tool_error_fraction=1.0), [ScriptedEngine()], problems(5))
    out = trajectory_metrics(samples)
    assert (out["tool/lookup/calls"], out["tool/lookup/exceptions"], out["tool/lookup/timeouts"]) == (5, 2, 0)
    assert out["tool/exceptions"] == 2 and out["tool/errors"] == 2  # tool/errors as it was: every error
    failed = [s for s in samples if s.trajectory.tool_exceptions]
    assert len(failed) == 2
    call = failed[0].trajectory.turns[0].calls[0]
    assert call["error"] and not call["timed_out"]
    # the model reads the type and the message, never the traceback
    assert call["result"] == "error: RuntimeError: the lookup service is down"
    exception = call["exception"]
    assert exception["type"] == "RuntimeError" and exception["message"] == "the lookup service is down"
    assert exception["traceback"].startswith("Traceback (most recent call last):")
    assert exception["traceback"].rstrip().endswith("RuntimeError: the lookup service is down")
    assert "in behavior" in exception["traceback"]  # the tool's own frame
    ok = next(s for s in samples if not s.trajectory.tool_exceptions).trajectory.turns[0].calls[0]
    assert "exception" not in ok


def test_the_record_carries_the_exception_to_rollouts_jsonl():
    tool = LookupLike(behavior=raise_boom())
    (sample,) = run(make_runner([tool], max_tool_error_fraction=1.0), [ScriptedEngine()])
    (record,) = rollout_records([sample], [PROBLEM], [{}], None, [sample], 1)
    call = record["turns"][0]["calls"][0]
    assert call["exception"]["type"] == "RuntimeError" and call["exception"]["message"] == "boom"
    assert "in deep" in call["exception"]["traceback"]
    assert record["tool_exceptions"] == 1 and record["tool_errors"] == 1


def test_a_long_message_reaches_the_model_as_its_first_line_cut_short():
    failure = ToolFailure.raised("t", "tool 't'", ValueError("x" * 500 + "\nsecond line"))
    assert failure.model_text() == "error: ValueError: " + "x" * 197 + "..."
    assert ToolFailure.raised("t", "tool 't'", KeyError()).model_text() == "error: KeyError"


def test_the_rollouts_timeout_counts_but_a_tool_reporting_a_timeout_does_not():
    async def hang(args):
        await asyncio.sleep(30)

    tool = LookupLike(behavior=hang)
    runner = make_runner([tool], timeouts={"lookup": 0.1}, max_tool_error_fraction=1.0)
    (sample,) = run(runner, [ScriptedEngine()])
    call = sample.trajectory.turns[0].calls[0]
    assert call["timed_out"] and call["exception"]["type"] == "TimeoutError"
    assert "timeout_s=0.1" in call["exception"]["message"] and call["exception"]["traceback"] == ""
    out = trajectory_metrics([sample])
    assert (out["tool/lookup/timeouts"], out["tool/lookup/exceptions"], out["tool/exceptions"]) == (1, 0, 0)

    async def own_timeout(args):  # the python tool killing the model's endless loop: the model's error
        return ToolResult("error: your code ran past 10 s", error=True, timed_out=True)

    tool = LookupLike(behavior=own_timeout)
    samples = run(make_runner([tool]), [ScriptedEngine()], problems(20))  # default fraction: goes on
    out = trajectory_metrics(samples)
    assert out["tool/timeouts"] == 20 and out["tool/lookup/timeouts"] == 0 and out["tool/lookup/calls"] == 20


def test_a_tool_raising_timeouterror_itself_is_an_exception_not_a_timeout():
    tool = LookupLike(behavior=failing_on({0}, TimeoutError("upstream timed out")))
    (sample,) = run(make_runner([tool], max_tool_error_fraction=1.0), [ScriptedEngine()])
    call = sample.trajectory.turns[0].calls[0]
    assert not call["timed_out"] and call["result"] == "error: TimeoutError: upstream timed out"
    assert trajectory_metrics([sample])["tool/lookup/exceptions"] == 1


def test_the_models_errors_do_not_count():
    """Deliberate error results (the model's code raised) and malformed calls: tool/errors and
    tool/parse_errors, never the fraction; a step of nothing else runs through."""

    async def model_error(args):
        return ToolResult("error: NameError: name 'x' is not defined", error=True)

    tool = LookupLike(behavior=model_error)
    samples = run(make_runner([tool]), [ScriptedEngine()], problems(20))
    out = trajectory_metrics(samples)
    assert out["tool/errors"] == 20 and out["tool/exceptions"] == 0 and out["tool/lookup/exceptions"] == 0
    assert all("exception" not in s.trajectory.turns[0].calls[0] for s in samples)

    def malformed(seen: str) -> str:  # calls a tool that does not exist, then answers
        return "7<eos>" if PLAIN_RESULT in seen else f"nope:1{CALL[-1]}"

    other = LookupLike()
    other.name, other.schema = "other", {**LookupLike.schema, "name": "other"}
    samples = run(make_runner([LookupLike(), other]), [ScriptedEngine(malformed)], problems(20))
    out = trajectory_metrics(samples)
    assert out["tool/parse_errors"] == 20 and out["tool/exceptions"] == 0
    assert not any(key.endswith("/calls") for key in out)  # nothing ran


# --- the limit ----------------------------------------------------------------------------------------------


def test_a_tool_that_always_raises_stops_the_round_early_naming_it():
    """A model that calls on every turn: 20 trajectories may make 8 calls each; after the first turn's 20
    failures no outcome of the other 140 can end the step under 5%, so the round stops there."""
    tool = LookupLike(behavior=raise_boom("the lookup service is down"))
    engine = ScriptedEngine(lambda seen: CALL)
    with pytest.raises(ToolFailureError) as stopped:
        run(make_runner([tool], max_turns=8, max_tool_calls=8), [engine], problems(20))
    message = str(stopped.value)
    assert message.startswith("tool 'lookup': ")
    assert "calls so far this step failed" in message and "rollout.max_tool_error_fraction=0.05" in message
    assert "last: RuntimeError: the lookup service is down" in message
    assert "fix the tool" in message and "ToolResult(error=True)" in message
    assert "\nlast traceback:\nTraceback (most recent call last):" in message
    assert message.rstrip().splitlines()[-1] == "RuntimeError: the lookup service is down"
    # the first check after more than 8 (5% of 160) failures stops it, with the other calls in flight
    failed = int(re.search(r"lookup': (\d+) of its \1 calls so far this step failed", message)[1])
    assert 8 < failed <= 20 and f"with at most {160 - failed} more calls this step" in message
    assert len(tool.args) == 20  # the first turn's calls; none of a second turn ran
    tool.assert_closed_once(20)


def test_failures_within_the_fraction_go_on():
    tool = LookupLike(behavior=failing_on({3, 17}))  # 2 of 40 calls: 5%, not more
    samples = run(make_runner([tool]), [ScriptedEngine()], problems(40))
    assert trajectory_metrics(samples)["tool/lookup/exceptions"] == 2
    tool = LookupLike(behavior=failing_on({3, 17, 30}))  # 3 of 40
    with pytest.raises(ToolFailureError, match="tool 'lookup'"):
        run(make_runner([tool]), [ScriptedEngine()], problems(40))
    tool = LookupLike(behavior=failing_on(set(range(40))))  # a fraction of 1 never stops
    samples = run(make_runner([tool], max_tool_error_fraction=1.0), [ScriptedEngine()], problems(40))
    assert trajectory_metrics(samples)["tool/lookup/exceptions"] == 40


def test_the_fraction_is_per_tool_and_counted_over_calls_that_ran():
    """`StepFailures` on its own: the bound it checks while calls are still possible, and the exact share
    once none are."""
    failure = ToolFailure.raised("a", "tool 'a'", RuntimeError("x"))

    def step_with_a_failure() -> tuple[StepFailures, Trajectory]:
        step = StepFailures(0.25, calls_left=8, failure_log=FailureLog(logger=logging.getLogger("quiet")))
        trajectory = Trajectory([], [])
        step.ran(trajectory, "a", failure, "here", "on")
        step.ran(trajectory, "b", None, "here", "on")
        step.check()  # 1 failure of at most 1 + 6 calls of a: 14% could still end under 25%
        return step, trajectory

    step, trajectory = step_with_a_failure()
    step.release(5)
    with pytest.raises(ToolFailureError) as stopped:
        step.check()  # at most 2 calls of a now: 1 > 0.25 * 2
    assert "1 of its 1 calls so far this step failed; with at most 1 more calls" in str(stopped.value)
    with pytest.raises(ToolFailureError, match="with at most 1 more calls"):
        step.check()  # a stopped round stays stopped (every trajectory still running raises it)
    step, trajectory = step_with_a_failure()
    step.release(6)  # every trajectory done: the exact share
    with pytest.raises(ToolFailureError) as stopped:
        step.check()
    assert "1 of its 1 calls this step failed (100%, more than rollout.max_tool_error_fraction=0.25)" in str(
        stopped.value
    )
    assert (
        trajectory.by_tool["a"].calls,
        trajectory.by_tool["a"].exceptions,
        trajectory.by_tool["b"].calls,
    ) == (
        1,
        1,
        1,
    )


def test_timeouts_count_toward_the_fraction_and_the_fix_says_timeout_s():
    async def hang(args):
        await asyncio.sleep(30)

    tool = LookupLike(behavior=hang)
    with pytest.raises(ToolFailureError) as stopped:
        run(make_runner([tool], timeouts={"lookup": 0.05}), [ScriptedEngine()], problems(4))
    message = str(stopped.value)
    assert re.search(r"\(0 raised, [1-4] timed out\)", message), message
    assert "last: TimeoutError: no result within timeout_s=0.05" in message
    assert "raise its timeout_s in rollout.tools" in message and "last traceback" not in message


# --- the log ------------------------------------------------------------------------------------------------


def test_each_failure_is_logged_with_its_traceback_then_counted(caplog):
    runner = make_runner([LookupLike(behavior=raise_boom())], max_tool_error_fraction=1.0)
    runner.failure_log = FailureLog(full=2, every=3)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        run(runner, [ScriptedEngine()], problems(10))
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    full, counted = lines[:2], lines[2:]
    for line in full:
        assert line.startswith("tool 'lookup' raised RuntimeError: boom (problem p")
        assert "turn 1; the model got an error result" in line
        assert (
            "Traceback (most recent call last):" in line
            and "in deep\n    raise RuntimeError(message)" in line
        )
    assert "further RuntimeError of it are counted" in full[1]
    # 8 more: a line at 3 and at 6, the last 2 at the end of the step; no tracebacks
    assert counted == [
        "tool 'lookup' failed 3 more times (RuntimeError x3), not logged in full; last: RuntimeError: boom",
        "tool 'lookup' failed 3 more times (RuntimeError x3), not logged in full; last: RuntimeError: boom",
        "tool 'lookup' failed 2 more times this step (RuntimeError x2), not logged in full; last: "
        "RuntimeError: boom",
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):  # the next step: counted only, the run remembers
        run(runner, [ScriptedEngine()], problems(2))
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER] == [
        "tool 'lookup' failed 2 more times this step (RuntimeError x2), not logged in full; last: "
        "RuntimeError: boom"
    ]


def test_a_new_exception_type_is_logged_in_full_again(caplog):
    log = FailureLog(full=1, every=100, logger=logging.getLogger(LOGGER))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for error in (RuntimeError("a"), RuntimeError("b"), KeyError("c"), RuntimeError("d")):
            try:
                raise error
            except Exception as raised:  # noqa: BLE001
                log.add(ToolFailure.raised("t", "tool 't'", raised), "here", "on")
        log.flush()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("tool 't' raised RuntimeError: a (here; on; further RuntimeError of it")
    assert lines[1].startswith("tool 't' raised KeyError: 'c' (here; on; further KeyError")
    assert "Traceback" in lines[0] and "Traceback" in lines[1]
    assert lines[2:] == ["tool 't' failed 2 more times this step (RuntimeError x2), not logged in full; "
                         "last: RuntimeError: d"]  # fmt: skip


# --- environments -------------------------------------------------------------------------------------------


class FlakyEnv:
    """Answers a turn with a hint, then ends; its step raises on the problems in `broken`."""

    def __init__(self, broken: set[str]):
        self.broken = broken
        self.closed: list[str] = []

    async def reset(self, problem):
        return EnvReset([{"role": "user", "content": problem.prompt}], {"id": problem.id, "turn": 0})

    async def step(self, state, assistant_message):
        if state["id"] in self.broken:
            raise ValueError(f"no board for {state['id']}")
        state["turn"] += 1
        if state["turn"] == 1:
            return EnvStep(messages=[{"role": "user", "content": "=3."}], reward=0.25)
        return EnvStep(reward=1.0, done=True)

    async def close(self, state):
        self.closed.append(state["id"])


def env_runner(env, fraction: float = 0.05) -> TrajectoryRunner:  # noqa: ANN001
    cfg = RolloutConfig(mode=RolloutMode.env, env="game.py:FlakyEnv", max_tool_error_fraction=fraction)
    fmt = PlainFormat(TOK, [])
    return TrajectoryRunner(cfg, SamplingConfig(max_new_tokens=8), fmt, UserEnv(env, cfg.env), EOS)


def test_an_environment_whose_step_raises_is_counted_recorded_and_bounded(caplog):
    env = FlakyEnv({"p1"})
    engine = ScriptedEngine(lambda s: "3<eos>" if "=" in s else "1<eos>")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        samples = run(env_runner(env, fraction=1.0), [engine], problems(3))
    broken = samples[1]
    assert broken.finish_reason == "abort" and len(broken.trajectory.turns) == 1
    assert broken.trajectory.turns[0].exception["message"] == "no board for p1"
    assert [s.finish_reason for s in (samples[0], samples[2])] == ["stop", "stop"]
    out = trajectory_metrics(samples)
    assert (out["tool/env/calls"], out["tool/env/exceptions"], out["tool/exceptions"]) == (5, 1, 1)
    (record,) = rollout_records([broken], [problems(2)[1]], [{}], None, [broken], 1)
    assert record["turns"][0]["exception"]["type"] == "ValueError" and record["tool_exceptions"] == 1
    (line,) = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert line.startswith(
        "environment 'game.py:FlakyEnv' raised ValueError: no board for p1 (problem p1, turn 1;"
    )
    assert "the trajectory ends (abort)" in line and "Traceback" in line
    assert sorted(env.closed) == ["p0", "p1", "p2"]

    env = FlakyEnv({f"p{i}" for i in range(20)})
    with pytest.raises(ToolFailureError) as stopped:
        run(env_runner(env), [engine], problems(20))
    message = str(stopped.value)
    assert message.startswith("environment 'game.py:FlakyEnv': ") and "fix the environment" in message
    assert message.rstrip().splitlines()[-1].startswith("ValueError: no board for p")
    assert "timeout_s" not in message


def test_tool_metrics_are_absent_without_calls_but_tool_exceptions_is_always_there():
    samples = run(make_runner(), [ScriptedEngine(lambda s: "7<eos>")], problems(2))
    out = trajectory_metrics(samples)
    assert out["tool/exceptions"] == 0 and "tool/lookup/calls" not in out
    samples = run(make_runner(), [ScriptedEngine(call_then_answer)], problems(2))
    assert trajectory_metrics(samples)["tool/lookup/calls"] == 2
