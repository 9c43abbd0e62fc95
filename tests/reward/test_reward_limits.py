"""Rewards fail loudly (issue 37): a timed-out call counts against reward.max_timeout_fraction, and a function
that always hangs stops its first step after a few calls, not batch x timeout_s; the scoring of a round has
a deadline (reward.step_timeout_s) that names the slowest function; `scored` counts only scores; and no
process a reward function starts outlives its worker. Real worker processes, real /proc."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
from grader_rules import SlowRule
from test_reward_fns import HERE, fn, samples

from dsv4rl.checks.validate import validate
from dsv4rl.config.choices import RewardOnError
from dsv4rl.config.compose import ConfigError, compose
from dsv4rl.config.schema import RewardConfig
from dsv4rl.data.problems import Problem
from dsv4rl.faults.proc_tree import process_table
from dsv4rl.metrics import StepTimer
from dsv4rl.reward.combine import check_timeout_fraction, function_metrics
from dsv4rl.reward.fn_pool import AsyncProcessPool
from dsv4rl.reward.fn_worker import call_target
from dsv4rl.reward.graders import PooledGrader
from dsv4rl.reward.results import TIMED_OUT, FnSpec, Outcome, RewardError
from dsv4rl.reward.rewarder import RewardSet
from dsv4rl.reward.scorers import BuiltinScorer
from dsv4rl.reward.step_limits import StepWatch
from dsv4rl.samples import Sample
from dsv4rl.targets import parse
from dsv4rl.train import rewarding
from dsv4rl.train.loop import RLLoop
from marked_processes import running_with

FNS = "user_fns.py"


@pytest.fixture
def marker_dir(tmp_path: Path) -> Path:
    folder = tmp_path / f"dsv4rl-test-{uuid.uuid4().hex[:12]}"
    folder.mkdir()
    yield folder
    for pid in running_with(folder.name):  # a failed test must not leave them either
        os.kill(pid, 9)


# ------------------------------------------------------------------------------------------- the pool
def test_no_process_a_call_starts_outlives_its_worker(marker_dir: Path) -> None:
    """The call starts a child, a child in a session of its own and a daemon (double fork + setsid), then
    hangs: at its timeout all three die with the worker. The same when the call kills its worker
    (os._exit), and when the pool closes after calls that returned. An orphan that exits is reaped."""
    targets = [parse(f"{FNS}:{name}", [HERE]) for name in ("spawns", "orphan")]
    pool = AsyncProcessPool(1, targets)
    loop = asyncio.new_event_loop()

    async def spawn_and(then: str, timeout_s: float = 30.0) -> tuple[list[int], object]:
        (marker_dir / "spawned").unlink(missing_ok=True)
        kwargs = {"marker_dir": str(marker_dir), "then": then}
        arguments = (targets[0], samples(["7"])[0], kwargs)
        call = asyncio.ensure_future(pool.call(call_target, arguments, timeout_s))
        while not (marker_dir / "spawned").exists() and not call.done():
            await asyncio.sleep(0.01)
        spawned = running_with(marker_dir.name)
        return spawned, await call

    try:
        loop.run_until_complete(pool.start())
        spawned, raw = loop.run_until_complete(spawn_and("hang", timeout_s=2.0))
        assert len(spawned) == 3, "the call did not start its three processes within its timeout"
        assert raw is TIMED_OUT and (pool.timeouts, pool.restarts) == (1, 1)
        assert running_with(marker_dir.name) == []
        _, raw = loop.run_until_complete(spawn_and("die"))
        assert raw.error_type == "WorkerDied" and len(list(marker_dir.glob("daemon-*"))) == 3  # and its retry
        assert running_with(marker_dir.name) == []
        reaper = pool._workers[0].process.pid
        call = pool.call(call_target, (targets[1], samples(["7"])[0], {"marker": marker_dir.name}), 30.0)
        assert loop.run_until_complete(call) == 1.0
        assert wait_for(lambda: not running_with(marker_dir.name))  # the orphan ended
        assert wait_for(lambda: not zombie_children(reaper)), "the orphan was left a zombie"
        spawned, raw = loop.run_until_complete(spawn_and("return"))
        assert raw == 1.0 and len(spawned) == 3 and len(running_with(marker_dir.name)) == 3
    finally:
        pool.close()
        loop.close()
    assert running_with(marker_dir.name) == []


def zombie_children(pid: int) -> list[int]:
    return [p.pid for p in process_table().values() if p.ppid == pid and p.state == "Z"]


def wait_for(condition, within_s: float = 10.0) -> bool:  # noqa: ANN001
    """Poll `condition` until it holds (True) or `within_s` passed (False): a bound, not a measurement."""
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# ------------------------------------------------------------------------------------------- the counts
def test_scored_counts_only_the_calls_that_returned_a_score() -> None:
    """on_error=zero turns a timeout or an error into a 0 that trains: no score the function gave."""
    spec = FnSpec("f", "t", 1.0, RewardOnError.zero, 1.0)
    outcomes = [
        {"f": Outcome(1.0)},
        {"f": Outcome(0.0)},
        {"f": Outcome(0.0, {}, "timeout", "no result within timeout_s=1")},
        {"f": Outcome(0.0, {}, "error", "ZeroDivisionError")},
        {"f": Outcome(None, {}, "none")},
    ]
    metrics = function_metrics([spec], outcomes)
    assert metrics["reward/f/scored"] == 2
    assert (metrics["reward/f/timeouts"], metrics["reward/f/errors"], metrics["reward/f/none"]) == (1, 1, 1)
    assert metrics["reward/f/score"] == 0.25  # the mean of what the samples got, the zeros included


def test_timeouts_past_the_fraction_stop_the_step_naming_the_function_and_its_timeout() -> None:
    spec = FnSpec("slow", "user_fns.py:sleepy", 1.0, RewardOnError.exclude, 0.5)
    timeout = {"slow": Outcome(None, {}, "timeout", "no result within timeout_s=0.5")}
    check_timeout_fraction([spec], [timeout] + [{"slow": Outcome(1.0)}] * 19, 0.05)  # 1 of 20: allowed
    with pytest.raises(RewardError) as raised:
        check_timeout_fraction([spec], [timeout] * 2 + [{"slow": Outcome(1.0)}] * 18, 0.05, step=3)
    message = str(raised.value)
    assert "reward function 'slow' (user_fns.py:sleepy): 2 of the 20 samples of step 3 timed out" in message
    assert "timeout_s=0.5" in message and "reward.max_timeout_fraction=0.05 allows (1)" in message
    assert "allows (1); the run stops rather than train on timeouts: fix what hangs" in message
    for fix in ("reward.timeout_s", "reward.fns[].timeout_s", "reward.num_workers"):
        assert fix in message


def test_the_allowance_counts_samples_and_grows_with_the_rounds_of_a_step() -> None:
    """A group call that times out counts for each sample of its group; dynamic sampling's second round of
    a step adds its samples to the allowance; a new step starts over."""
    spec = FnSpec("g", "user_fns.py:ranks", 1.0, RewardOnError.zero, 2.0, group=True)
    watch = StepWatch(max_timeout_fraction=0.25)

    async def timed_out() -> object:
        return TIMED_OUT

    async def rounds() -> None:
        watch.begin_round(1, 16)  # allows 4
        await watch.call(spec, timed_out(), 4, None)
        assert not watch.tripped.done()
        watch.begin_round(1, 16)  # 32 samples: allows 8
        await watch.call(spec, timed_out(), 4, None)
        assert not watch.tripped.done()
        await watch.call(spec, timed_out(), 4, None)
        assert "'g' (user_fns.py:ranks): 12 of the 32 samples of step 1 timed out" in watch.tripped.result()
        watch.begin_round(2, 16)
        await watch.call(spec, timed_out(), 4, None)
        assert not watch.tripped.done()

    asyncio.run(rounds())


def test_the_two_keys_are_validated() -> None:
    cfg = compose("tiny_arith", ["reward.max_timeout_fraction=0.2", "reward.step_timeout_s=30"])
    assert (cfg.reward.max_timeout_fraction, cfg.reward.step_timeout_s) == (0.2, 30.0)
    assert (RewardConfig().max_timeout_fraction, RewardConfig().step_timeout_s) == (0.05, 600.0)
    cfg.reward.max_timeout_fraction, cfg.reward.step_timeout_s = 1.5, -1.0
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    problems = info.value.problems
    assert any("reward.max_timeout_fraction must be in [0, 1] (got 1.5)" in p for p in problems)
    assert any("reward.step_timeout_s must be a number >= 0 (got -1.0)" in p for p in problems)


# ------------------------------------------------------------------------------------------- a round
GROUPS, GROUP_SIZE = 4, 8


def _loop_with(cfg: RewardConfig) -> RLLoop:
    """An RLLoop with only what collect_batch reads: GROUPS groups of GROUP_SIZE samples, which the fake
    generation (`_slow_generation`) hands to the scoring at once."""
    run = compose("tiny_arith", [f"algo.group_size={GROUP_SIZE}", "run.save_rollouts=0"])
    run.algo.dynamic_sampling.enabled = False
    run.reward = cfg
    loop = RLLoop.__new__(RLLoop)
    loop.cfg = run
    loop.backend = SimpleNamespace(data_parallel_size=1)
    loop.driver = SimpleNamespace(
        stream=SimpleNamespace(next_batch=lambda: [Problem(f"{i}+7=", "7", f"p{i}") for i in range(GROUPS)]),
        rewards=RewardSet.from_config(cfg, [HERE]),
        tokenizer=SimpleNamespace(pad_token_id=0),
        live_clients=lambda: None,  # the patched generation takes no engines
        roster=None,
        event_loop=asyncio.new_event_loop(),
        renderer=None,
        parser=None,
        multi_turn=None,
    )
    return loop


GENERATION_CANCELLED: list[bool] = []


async def _slow_generation(clients, problems, tokenizer, group_size, *args, on_group=None, **kwargs):  # noqa: ANN001, ANN202
    """Every group is back at once; then the engines take a minute more (as if other prompts were still
    generating): only a scoring that stops the round ends it sooner."""
    out = []
    for group in range(len(problems)):
        out += [Sample(group, [1, 2], [3], [-0.5], "7", "stop", answer="7") for _ in range(group_size)]
        on_group(group, out[-group_size:])
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        GENERATION_CANCELLED.append(True)
        raise
    return out


def _collect(loop: RLLoop) -> None:
    try:
        loop.collect_batch(1, StepTimer(), background=True)
    finally:
        loop.driver.rewards.close()
        loop.driver.event_loop.close()


def test_a_function_that_always_hangs_stops_the_first_step_after_a_few_calls(monkeypatch) -> None:
    """32 samples, one worker, a function that never returns: the 2nd timeout passes what 0.05 of 32
    allows (1), the round stops there, its generation with it, and the other 30 calls never run (without
    the early stop: a minute of generation, then 32 timeouts one after another)."""
    monkeypatch.setattr(rewarding, "generate_samples", _slow_generation)
    GENERATION_CANCELLED.clear()
    cfg = RewardConfig(
        fns=[fn("ok", "builtin:arith"), fn("hang", "hangs", timeout_s=0.3, on_error="zero", weight=0.0)]
    )
    loop = _loop_with(cfg)
    pool = loop.driver.rewards.pool
    with pytest.raises(RewardError) as raised:
        _collect(loop)
    message = str(raised.value)
    assert "reward function 'hang' (user_fns.py:hangs): 2 of the 32 samples of step 1 timed out" in message
    assert "timeout_s=0.3" in message and "the step's other calls were cancelled and the run stops" in message
    assert pool.timeouts == 2  # not 32: the rest were cancelled
    assert GENERATION_CANCELLED == [True]  # the round stopped without waiting for its generation


def test_the_scoring_deadline_names_the_function_with_the_most_calls_unfinished(monkeypatch) -> None:
    """Generation ends; two functions are still busy (a slow one per sample in one worker, a slow async
    group function): after reward.step_timeout_s the run stops naming the one with more calls left."""

    async def generated(clients, problems, tokenizer, group_size, *args, on_group=None, **kwargs):  # noqa: ANN001, ANN202
        out = []
        for group in range(len(problems)):
            batch = [Sample(group, [1, 2], [3], [-0.5], "7", "stop", answer="7") for _ in range(group_size)]
            on_group(group, batch)
            out += batch
        return out

    monkeypatch.setattr(rewarding, "generate_samples", generated)
    cfg = RewardConfig(
        step_timeout_s=0.5,
        fns=[fn("ok", "builtin:arith"),
             fn("slow", "sleepy", weight=0.0, timeout_s=30.0, kwargs={"delay": 30.0, "every": 1}),
             fn("judge", "async_slow", weight=0.0, timeout_s=30.0, group=True)],
    )  # fmt: skip
    with pytest.raises(RewardError) as raised:
        _collect(_loop_with(cfg))
    message = str(raised.value)
    assert "reward scoring of step 1 did not finish within reward.step_timeout_s=0.5" in message
    assert "the slowest is reward function 'slow' (user_fns.py:sleepy), 32 calls unfinished" in message
    assert "also unfinished: 'judge' 4" in message
    assert "reward.num_workers" in message and "raise reward.step_timeout_s" in message


def test_a_pooled_grader_s_timeouts_count_the_same_way() -> None:
    """math-verify's pool (a builtin in a pool, timed out by the worker's alarm): one timeout in 40 samples is
    allowed (a pathological answer now and then), the third passes 0.05 of 40 and stops the step."""
    spec = FnSpec("mv", "builtin:slow", 1.0, RewardOnError.zero, 0.3, zero=-1.0)
    grader = PooledGrader(SlowRule(), timeout_s=0.3)
    rewards = RewardSet([BuiltinScorer(spec, grader)], None, 0.05)
    loop = asyncio.new_event_loop()

    async def two_groups() -> tuple[list[dict[str, Outcome]], str]:
        rewards.begin_round(1, 40)
        first = await rewards.score_group(samples(["slow"] + ["7"] * 19))
        assert [o["mv"].status for o in first.outcomes] == ["timeout"] + ["ok"] * 19
        with pytest.raises(RewardError) as raised:
            await rewards.score_group(samples(["slow", "slow"] + ["7"] * 18))
        return first.outcomes, str(raised.value)

    try:
        outcomes, message = loop.run_until_complete(two_groups())
    finally:
        rewards.close()
        loop.close()
    assert rewards.combine(outcomes).metrics["reward/mv/timeouts"] == 1  # 1 of 20: no stop
    assert "reward function 'mv' (builtin:slow): 3 of the 40 samples of step 1 timed out" in message
    assert "(no result within timeout_s=0.3)" in message
