"""Preemption end to end on tiny_arith: a SIGTERM to `dsv4rl train` (Slurm's scancel, or the batch script
passing `--signal=B:USR1` on), then a SIGUSR1 straight to trainer rank 0 (Slurm's `--signal` without `B:`
reaches every process of the job), each ends the step in progress with a checkpoint and exit code 75;
`resume=auto` continues, and the three sessions give the reward curve of an uninterrupted run."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from cli_runs import CLI, NON_TIMING, train

from dsv4rl.faults.stop import STOPPED_EXIT
from dsv4rl.metrics import read_metrics
from free_ports import port_overrides

pytestmark = pytest.mark.slow

STEPS = 10
SETTINGS = (f"train.steps={STEPS}", "train.checkpoint_every=5")


def start(run_dir: Path) -> subprocess.Popen:
    argv = [*CLI, "recipe=tiny_arith", f"run.dir={run_dir}", "run.progress=false", *SETTINGS, "resume=auto"]
    return subprocess.Popen(
        [*argv, *port_overrides()], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def wait_for_steps(run_dir: Path, steps: int, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 600
    while len(read_metrics(run_dir / "metrics.jsonl")) < steps:
        assert process.poll() is None, process.stdout.read()
        assert time.monotonic() < deadline, f"fewer than {steps} steps in 600 s"
        time.sleep(0.1)


def stopped(run_dir: Path, process: subprocess.Popen) -> tuple[int, str]:
    """Wait for the stop: exit code 75 within 60 s, a checkpoint of the last step in metrics.jsonl."""
    sent = time.monotonic()
    try:
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == STOPPED_EXIT, output
    assert time.monotonic() - sent < 60, output
    record = json.loads((run_dir / "STOPPED").read_text())
    step = record["step"]
    assert len(read_metrics(run_dir / "metrics.jsonl")) == step < STEPS
    assert record["checkpoint"] == str(run_dir / "checkpoints" / f"step_{step:08d}")
    assert (Path(record["checkpoint"]) / "trainer_state.pt").is_file()
    assert f"stopped after step {step}" in output and "resume=auto" in output
    return step, output


def refused_second_launcher(run_dir: Path) -> None:
    """A second `dsv4rl train` on the running run's dir, with ports of its own: refused, nothing written."""
    config = (run_dir / "config.yaml").stat().st_mtime_ns
    argv = [*CLI, "recipe=tiny_arith", f"run.dir={run_dir}", "run.progress=false", *SETTINGS, "resume=auto"]
    result = subprocess.run([*argv, *port_overrides()], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"run.dir {run_dir} is in use by another dsv4rl train (pid " in result.stderr
    assert (run_dir / "config.yaml").stat().st_mtime_ns == config


def test_preempt_sigterm_then_a_rank_signal_resume_to_the_uninterrupted_curve(tmp_path: Path) -> None:
    straight, run_dir = tmp_path / "straight", tmp_path / "preempted"
    train(straight, *SETTINGS)

    process = start(run_dir)  # resume=auto on an empty run dir: a fresh run
    wait_for_steps(run_dir, 2, process)
    process.send_signal(signal.SIGTERM)
    first, output = stopped(run_dir, process)
    assert "resume=auto: no checkpoint in" in output
    assert "SIGTERM received: the trainer ends its step, writes a checkpoint and exits" in output

    process = start(run_dir)
    wait_for_steps(run_dir, first + 1, process)
    refused_second_launcher(run_dir)
    wait_for_steps(run_dir, first + 2, process)  # the lines of this session: after the checkpoint's
    rank0 = json.loads((run_dir / "logs" / "heartbeat-trainer-rank0.json").read_text())["pid"]
    dumped_before = (run_dir / "logs" / "stacks-trainer-rank0.txt").stat().st_size
    subprocess.run(["kill", "-USR1", str(rank0)], check=True)
    second, output = stopped(run_dir, process)
    assert second > first
    assert f"resume=auto: continuing from {run_dir / 'checkpoints' / f'step_{first:08d}'}" in output
    printed = [line.split(" |")[0] for line in output.splitlines() if line.startswith("step ")]
    assert printed == [f"step {step}/{STEPS}" for step in range(first + 1, second + 1)]  # this session's
    stacks = (run_dir / "logs" / "stacks-trainer-rank0.txt").read_text()[dumped_before:]
    assert "most recent call first" in stacks  # SIGUSR1 still dumps the rank's stacks

    result = train(run_dir, *SETTINGS, "resume=auto")
    assert f"step {second + 1}/{STEPS}" in result.stdout and "step 1/" not in result.stdout
    ours, theirs = (read_metrics(run / "metrics.jsonl") for run in (run_dir, straight))
    assert [line["step"] for line in ours] == list(range(1, STEPS + 1))
    for mine, uninterrupted in zip(ours, theirs, strict=True):
        assert {key: mine[key] for key in NON_TIMING} == {key: uninterrupted[key] for key in NON_TIMING}
