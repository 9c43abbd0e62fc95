"""An engine dies or hangs and the run goes on (issue: engine restarts): `dsv4rl train recipe=tiny_arith`
with two engines. The killed or hung engine is restarted by the supervisor, its requests go to the other
engine meanwhile, it rejoins the weight-update group at a sync and is probed before it takes requests;
the trainer never restarts and no checkpoint is read. With `engine.max_restarts=0` the same fault stops
the run as before."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_runs import LEARNING_STEPS

from dsv4rl.config.choices import QuantMode
from dsv4rl.faults.inject import HANG_ENV, KILL_ENV
from dsv4rl.metrics import read_metrics
from dsv4rl.sync.verify import PROBE_BOUNDS
from free_ports import port_overrides

pytestmark = pytest.mark.slow
# run.step_timeout_s of the restart run: well above a real phase of its steps (about a second each), and
# what the hung engine's step lasts longer
TIMEOUT_S = 30
SMALL = ("algo.prompts_per_step=4", "algo.group_size=4", "eval.every_steps=0")  # wiring, not learning


def train(run_dir: Path, env: dict[str, str], *overrides: str) -> subprocess.CompletedProcess:
    argv = [
        sys.executable, "-m", "dsv4rl.cli", "train", "recipe=tiny_arith", f"run.dir={run_dir}",
        "run.progress=false", "parallel.rollout.num_engines=2", *port_overrides(), *overrides,
    ]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=900, env={**os.environ, **env})


def test_killed_and_hung_engines_restart_rejoin_and_the_run_still_learns(tmp_path: Path) -> None:
    """One 120-step run in one trainer process, three faults: engine-1 killed as it generates with the
    weights of step 20 (the step's log-prob probe: done again on engine-0), engine-0 killed in the middle
    of the broadcast of step 30's weights (that push is made again to engine-1 alone), and engine-1 hung
    as it generates with the weights of step 40 (the probe again: the watchdog pins the hang on engine-1
    after run.step_timeout_s, the supervisor kills it). Every engine comes back, every rejoin is probed,
    and the recipe's learning target is met. A rollout call sent again whole to the other engine is
    tests/rollout/test_generate.py's (on the real reference engine)."""
    run_dir = tmp_path / "run"
    faults = {KILL_ENV: "engine-1:generate:20,engine-0:weight_broadcast:30", HANG_ENV: "engine-1:generate:40"}
    result = train(run_dir, faults, f"run.step_timeout_s={TIMEOUT_S}", "engine.health_timeout_s=3")
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "! engine-1 was killed by SIGKILL (exit code -9): restarting it with its command and ports" in out
    assert "! engine-0 was killed by SIGKILL (exit code -9): restarting it" in out
    hang = f"in phase verify at step 40 (run.step_timeout_s={TIMEOUT_S}): engine-1 did not advance, busy in"
    assert hang in out and "killing engine-1 to restart it" in out, out
    assert "(restart 2 of engine.max_restarts=3)" in out
    assert out.count("rejoined the weight-update group") == 3, out
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, LEARNING_STEPS + 1))
    assert metrics[-1]["engine/restarts"] == 3 and metrics[-1]["engine/alive"] == 2
    # engine-1 dies in step 20's probe (sync.verify every 10 steps) and hangs in step 40's, done again on
    # engine-0; engine-0 dies in the push of step 30, made again to engine-1: each ends with one engine
    assert [metrics[i]["engine/alive"] for i in (19, 29, 39)] == [1, 1, 1]
    # every sync an engine rejoined at was probed, within the bound of the run's quant mode
    rejoins = [m for i, m in enumerate(metrics[1:]) if m["engine/restarts"] > metrics[i]["engine/restarts"]]
    assert len(rejoins) == 3
    bound = PROBE_BOUNDS[QuantMode.none]  # the recipe's quant
    assert all(m["verify_probe_abs_diff"] <= bound for m in rejoins), rejoins
    last10 = sum(m["reward_mean"] for m in metrics[-10:]) / 10
    assert last10 >= 0.9, f"last-10 reward {last10:.3f}"
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert trainer_log.count("starting trainer:") == 1 and "resumed from" not in trainer_log
    assert "pushing the weights of step 30 again, to the engines that answer" in trainer_log


def test_without_restarts_a_killed_engine_stops_the_run_as_before(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    kill = {KILL_ENV: "engine-1:generate:1"}
    result = train(run_dir, kill, "train.steps=3", *SMALL, "engine.max_restarts=0")
    assert result.returncode == 128 + 9, result.stdout + result.stderr
    assert "✗ engine-1 was killed by SIGKILL (exit code -9)" in result.stdout
    assert "restarting" not in result.stdout


def test_with_async_rollouts_a_killed_engines_calls_are_resent_and_it_rejoins(tmp_path: Path) -> None:
    """algo.async_rollout: the next batch generates on a background thread while the trainer trains, so
    the lost engine is met there (its call resent to engine-0), and the group is rebuilt at a sync that
    waits for that batch first."""
    run_dir = tmp_path / "run"
    steps = 60  # the restarted engine loads (~10 s on 2 busy cores) while the steps go on, then rejoins
    asynchronous = ("algo.async_rollout=true", "algo.tis.enabled=true")
    kill = {KILL_ENV: "engine-1:generate:2"}  # step 4's batch, generated while step 3 trains
    result = train(run_dir, kill, f"train.steps={steps}", *SMALL, *asynchronous, "engine.health_timeout_s=3")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "! engine-1 was killed by SIGKILL (exit code -9): restarting it" in result.stdout
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert metrics[-1]["rollout/resent"] >= 1
    assert metrics[-1]["engine/restarts"] == 1 and metrics[-1]["engine/alive"] == 2
