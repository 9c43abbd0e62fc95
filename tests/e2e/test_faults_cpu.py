"""The hang watchdog on a real run of the tiny model: a hang injected in the trainer loop and in the
reference engine (DSV4RL_INJECT_HANG) stops `dsv4rl train` after `run.step_timeout_s`, with every
process's Python stacks in the run dir and a message naming the phase and the process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4rl.faults.inject import HANG_ENV

pytestmark = pytest.mark.slow
TIMEOUT_S = 30  # well above a real phase of these small steps on 2 busy cores


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def hung_run(run_dir: Path, hang: str, *overrides: str) -> subprocess.CompletedProcess:
    argv = [
        sys.executable, "-m", "dsv4rl.cli", "train", "recipe=tiny_arith", f"run.dir={run_dir}",
        "run.progress=false", f"run.step_timeout_s={TIMEOUT_S}", "train.steps=3", "eval.every_steps=0",
        "algo.prompts_per_step=4", "algo.group_size=4",  # 16 samples a step: a loaded machine's train
        # phase of the recipe's 512 took 28 s
        f"engine.port={free_port()}", f"cluster.master_port={free_port()}",
        f"cluster.weight_sync_port={free_port()}", *overrides,
    ]  # fmt: skip
    result = subprocess.run(
        argv, capture_output=True, text=True, timeout=600, env={**os.environ, HANG_ENV: hang}
    )
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
