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
TIMEOUT_S = 20  # run.step_timeout_s of the hang run: well above a real phase of its small steps
HANG_RUN_STEPS = 24  # the restarted engine loads (~15 s on 2 busy cores) while the steps go on, then rejoins
SMALL = ("algo.prompts_per_step=4", "algo.group_size=4", "eval.every_steps=0")  # wiring, not learning


def train(run_dir: Path, env: dict[str, str], *overrides: str) -> subprocess.CompletedProcess:
    argv = [
        sys.executable, "-m", "dsv4rl.cli", "train", "recipe=tiny_arith", f"run.dir={run_dir}",
        "run.progress=false", "parallel.rollout.num_engines=2", *port_overrides(), *overrides,
    ]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=900, env={**os.environ, **env})


def test_two_killed_engines_restart_rejoin_and_the_run_still_learns(tmp_path: Path) -> None:
    """engine-1 killed as it generates with the weights of step 20 (the step's log-prob probe), engine-0
    killed in the middle of the broadcast of step 30's weights (that push is made again to engine-1
    alone): 120 steps in one trainer process, both engines back, and the recipe's learning target met.
    A rollout call sent again is the hang test's (below) and tests/rollout/test_generate.py's."""
    run_dir = tmp_path / "run"
    result = train(run_dir, {KILL_ENV: "engine-1:generate:20,engine-0:weight_broadcast:30"})
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "! engine-1 was killed by SIGKILL (exit code -9): restarting it with its command and ports" in out
    assert "! engine-0 was killed by SIGKILL (exit code -9): restarting it" in out
    assert out.count("rejoined the weight-update group") == 2, out
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, LEARNING_STEPS + 1))
    assert metrics[-1]["engine/restarts"] == 2 and metrics[-1]["engine/alive"] == 2
    # engine-1 dies in step 20's probe (sync.verify every 10 steps), done again on engine-0; engine-0 in the
    # push of step 30, made again to engine-1: each of those steps ends with one engine
    assert metrics[19]["engine/alive"] == 1 and metrics[29]["engine/alive"] == 1
    # every sync an engine rejoined at was probed, within the bound of the run's quant mode
    rejoins = [m for i, m in enumerate(metrics[1:]) if m["engine/restarts"] > metrics[i]["engine/restarts"]]
    assert len(rejoins) == 2
    bound = PROBE_BOUNDS[QuantMode.none]  # the recipe's quant
    assert all(m["verify_probe_abs_diff"] <= bound for m in rejoins), rejoins
    last10 = sum(m["reward_mean"] for m in metrics[-10:]) / 10
    assert last10 >= 0.9, f"last-10 reward {last10:.3f}"
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert trainer_log.count("starting trainer:") == 1 and "resumed from" not in trainer_log
    assert "pushing the weights of step 30 again, to the engines that answer" in trainer_log


def test_an_engine_hung_in_generate_is_killed_restarted_and_the_step_finishes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = train(run_dir, {HANG_ENV: "engine-1:generate:2"}, f"train.steps={HANG_RUN_STEPS}", *SMALL,
                   f"run.step_timeout_s={TIMEOUT_S}", "engine.health_timeout_s=3")  # fmt: skip
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert f"(run.step_timeout_s={TIMEOUT_S}): engine-1 did not advance, busy in generate" in out, out
    assert "killing engine-1 to restart it" in out
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, HANG_RUN_STEPS + 1))
    assert metrics[2]["rollout/resent"] == 1 and metrics[2]["engine/alive"] == 1  # step 3 went on without it
    assert metrics[-1]["engine/restarts"] == 1 and metrics[-1]["engine/alive"] == 2


def test_without_restarts_a_killed_engine_stops_the_run_as_before(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    kill = {KILL_ENV: "engine-1:generate:1"}
    result = train(run_dir, kill, "train.steps=3", *SMALL, "engine.max_restarts=0")
    assert result.returncode == 128 + 9, result.stdout + result.stderr
    assert "✗ engine-1 was killed by SIGKILL (exit code -9)" in result.stdout
    assert "restarting" not in result.stdout
