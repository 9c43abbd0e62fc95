"""Faults on a real run of the tiny model, injected at precise points (`dsv4rl.faults.inject`).

A hang in the trainer loop, in the reference engine's generate and inside its weight update
(DSV4RL_INJECT_HANG) stops `dsv4rl train` after `run.step_timeout_s`, with every process's Python stacks
in the run dir and a message naming the phase and the process. An engine killed in the middle of a weight
broadcast (DSV4RL_INJECT_KILL) stops the run naming the engine, its work and the trainer's phase, with
no process left; `resume=true` then continues, past a newest checkpoint broken since it was written."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_two_nodes_cpu import processes_of

from dsv4rl.faults.inject import HANG_ENV, KILL_ENV
from dsv4rl.faults.run_outcome import read_run_outcome
from dsv4rl.metrics import read_metrics
from dsv4rl.train.checkpoint_dirs import checkpoint_dir, complete_checkpoints
from free_ports import port_overrides

pytestmark = pytest.mark.slow
TIMEOUT_S = 20  # well above a real phase of these small steps (about a second) on 2 busy cores


def run(run_dir: Path, env: dict[str, str], *overrides: str) -> subprocess.CompletedProcess:
    argv = [
        sys.executable, "-m", "dsv4rl.cli", "train", "recipe=tiny_arith", f"run.dir={run_dir}",
        "run.progress=false", f"run.step_timeout_s={TIMEOUT_S}", "train.steps=3", "eval.every_steps=0",
        "algo.prompts_per_step=4", "algo.group_size=4",  # 16 samples a step: a loaded machine's train
        # phase of the recipe's 512 took 28 s
        *port_overrides(), *overrides,
    ]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, env={**os.environ, **env})


def hung_run(run_dir: Path, hang: str, *overrides: str) -> subprocess.CompletedProcess:
    result = run(run_dir, {HANG_ENV: hang}, *overrides)
    assert result.returncode == 1, result.stdout + result.stderr
    return result


def test_a_trainer_hung_in_train_stops_the_run_with_its_stacks(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    out = hung_run(run_dir, "trainer:train:2").stdout
    assert (
        f"in phase train at step 2 (run.step_timeout_s={TIMEOUT_S}): trainer-rank0 did not advance" in out
    ), out
    logs = run_dir / "logs"
    stacks = (logs / "stacks-trainer-rank0.txt").read_text()
    assert "dsv4rl/train/loop.py" in stacks and " in step\n" in stacks and " in main\n" in stacks
    assert "uvicorn" in (logs / "stacks-engine-0.txt").read_text()  # the engine dumped too
    assert f"Python stacks: {logs / 'stacks-engine-0.txt'}" in out
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 1  # step 1 done, step 2 never
    assert "hung" in out


def test_an_engine_hung_in_generate_is_named(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # no log-prob probe: its generate request would meet the hang in the first weight sync, not in rollout
    out = hung_run(run_dir, "engine-0:generate", "sync.verify.logprob_probe=false").stdout
    named = f"in phase rollout at step 1 (run.step_timeout_s={TIMEOUT_S}): engine-0 did not advance"
    assert f"{named}, busy in generate" in out
    assert "while trainer-rank0 waits on it in rollout at step 1" in out, out
    stacks = (run_dir / "logs" / "stacks-engine-0.txt").read_text()
    assert "dsv4rl/engine/generator.py" in stacks and " in _loop\n" in stacks
    assert " in collect_batch\n" in (run_dir / "logs" / "stacks-trainer-rank0.txt").read_text()


def test_an_engine_hung_in_a_weight_update_is_named_while_the_trainer_waits_in_sync(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    out = hung_run(run_dir, "engine-0:weight_update:2").stdout  # the update of step 2's weights
    named = f"in phase sync at step 2 (run.step_timeout_s={TIMEOUT_S}): engine-0 did not advance"
    assert f"{named}, busy in weight_update" in out, out
    assert "while trainer-rank0 waits on it in sync at step 2" in out, out
    stacks = (run_dir / "logs" / "stacks-engine-0.txt").read_text()
    assert "dsv4rl/engine/weight_routes.py" in stacks and " in block_forever\n" in stacks
    assert " in push_weights\n" in (run_dir / "logs" / "stacks-trainer-rank0.txt").read_text()


def test_an_engine_killed_mid_broadcast_stops_the_run_and_resume_continues_past_a_broken_checkpoint(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    saving = ("train.checkpoint_every=1", "train.keep_checkpoints=3")
    killed = run(run_dir, {KILL_ENV: "engine-0:weight_broadcast:3"}, *saving)  # step 3's weights in flight
    out = killed.stdout
    assert killed.returncode == 128 + signal.SIGKILL, out + killed.stderr
    assert (
        "✗ engine-0 was killed by SIGKILL (exit code -9) during weight_update at step 3; trainer-rank0 was "
        "in sync at step 3"
    ) in out, out
    assert f"{KILL_ENV}: engine-0 is killed in weight_broadcast at step 3" in out  # the engine's log tail
    assert processes_of(run_dir) == []  # the trainer stopped by the supervisor, nothing orphaned
    assert [m["step"] for m in read_metrics(run_dir / "metrics.jsonl")] == [1, 2]
    ended = read_run_outcome(run_dir)  # what `dsv4rl report` and `dsv4rl rollouts` say of it
    assert ended is not None and ended.outcome == "failed" and ended.exit_code == killed.returncode
    assert ended.sentence().startswith("crashed at step 2 (root cause: engine-0 was killed by SIGKILL"), ended
    checkpoints = run_dir / "checkpoints"
    assert complete_checkpoints(checkpoints) == [checkpoint_dir(checkpoints, s) for s in (2, 1)]

    # The newest checkpoint breaks on disk afterwards (a truncated shard): resume names it and takes step 1
    (shard,) = checkpoint_dir(checkpoints, 2).glob("*.distcp")
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    resumed = run(run_dir, {}, *saving, "resume=true")
    out = resumed.stdout
    assert resumed.returncode == 0, out + resumed.stderr
    broken = (
        f"! trainer-rank0: checkpoint {checkpoint_dir(checkpoints, 2)} cannot be loaded (model/optimizer "
        "shards (*.distcp): RuntimeError: PytorchStreamReader failed reading zip archive"
    )
    assert broken in out and "; falling back to step_00000001\n" in out, out
    said = f"resumed from the older checkpoint {checkpoint_dir(checkpoints, 1)} instead"
    assert f"! trainer-rank0: {said}" in out
    log = (run_dir / "logs" / "trainer.log").read_text()
    assert "cannot be loaded (model/optimizer shards" in log and said in log
    assert [m["step"] for m in read_metrics(run_dir / "metrics.jsonl")] == [1, 2, 3]
    assert read_run_outcome(run_dir).sentence() == "finished at step 3"
    assert "3 / 3 (steps 2-3 in this run: resumed)" in out, out  # never the earlier run's steps
    assert "step 1/3" not in out  # the earlier run's line is not printed again
