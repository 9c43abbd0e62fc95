"""The supervisor's graceful stop, with fake children: a fake engine and a fake trainer that keeps the
stop protocol (its heartbeat says it is stepping; at each step boundary it reads `<run_dir>/STOP`, then
writes `<run_dir>/STOPPED` and exits 0, as trainer rank 0 does)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from test_supervisor import (
    PIDS,
    assert_all_gone,
    capture,
    engine_spec,
    in_watch_loop,
    rollout_node,
    wait_for,
    written_pids,
)

from dsv4rl.faults.stop import STOPPED_EXIT, read_stop_request
from dsv4rl.launcher.marker import DoneMarker, write_marker
from dsv4rl.launcher.plan import ProcessSpec
from dsv4rl.launcher.supervisor import Supervisor
from free_ports import free_port

TRAINER = (
    PIDS
    + r"""
import json, time
from pathlib import Path
from dsv4rl.faults import heartbeat
from dsv4rl.faults.child import child_process
from dsv4rl.faults.stop import read_stop_request, write_stopped
run_dir, steps, mode = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
with child_process("trainer", rank=0):
    spawn_grandchild(str(run_dir / "trainer.pids"), new_session=True)
    if mode == "starting":  # still loading its model: it has not left the start phase
        time.sleep(120)
    first = 1
    if mode == "resumed":  # as MetricsWriter on resume: the lines after the checkpoint's step go
        metrics = run_dir / "metrics.jsonl"
        kept = [l for l in metrics.read_text().splitlines() if json.loads(l)["step"] <= 4]
        metrics.write_text("".join(l + "\n" for l in kept))
        first = 5
    for step in range(first, steps + 1):
        reason = read_stop_request(run_dir)
        if reason is not None and mode != "stubborn":  # a step boundary: checkpoint, record, leave
            checkpoint = run_dir / "checkpoints" / f"step_{step - 1:08d}"
            checkpoint.mkdir(parents=True)
            while mode == "outlives_engine" and not (run_dir / "engine-gone").exists():
                time.sleep(0.02)
            write_stopped(run_dir, step - 1, str(checkpoint), reason)
            sys.exit(0)
        heartbeat.enter("train", step)
        rec = {"step": step, "reward_mean": step / 10, "time_step_s": 0.05, "time_train_s": 0.05}
        with open(run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        time.sleep(0.05)
"""
)


def trainer_spec(run_dir: Path, steps: int = 100_000, mode: str = "ok") -> ProcessSpec:
    return ProcessSpec(
        name="trainer",
        argv=[sys.executable, "-c", TRAINER, str(run_dir), str(steps), mode],
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        log_path=run_dir / "logs" / "trainer.log",
        role="trainer",
    )


def supervisor(run_dir: Path, mode: str = "ok", steps: int = 100_000, **kwargs) -> tuple[Supervisor, object]:
    console, out = capture()
    kwargs.setdefault("stop_grace_s", 60.0)
    specs = [engine_spec(run_dir, free_port()), trainer_spec(run_dir, steps, mode)]
    sup = Supervisor(
        specs,
        run_dir,
        total_steps=steps,
        console=console,
        grace_s=3.0,
        poll_s=0.05,
        startup_timeout_s=20.0,
        resume_hint="dsv4rl train recipe=x run.dir=y resume=auto",
        **kwargs,
    )
    return sup, out


def metrics_lines(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def signal_when(condition, *signals: int, between=lambda: True) -> threading.Thread:
    """Send `signals` to this process (the supervisor's) once `condition()` holds, each next one once
    `between()` holds."""

    def run() -> None:
        deadline = time.monotonic() + 60
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.02)
        for index, sig in enumerate(signals):
            while index and not between() and time.monotonic() < deadline:
                time.sleep(0.02)
            os.kill(os.getpid(), sig)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=lambda s: signal.Signals(s).name)
def test_preempt_signal_stops_at_a_step_boundary_and_says_how_to_resume(tmp_path, sig) -> None:
    sup, out = supervisor(tmp_path)
    before = signal.getsignal(sig)
    thread = signal_when(lambda: metrics_lines(tmp_path) >= 2, sig)
    assert sup.run() == STOPPED_EXIT
    thread.join()
    assert signal.getsignal(sig) is before
    text = out.getvalue()
    name = signal.Signals(sig).name
    assert f"{name} received: the trainer ends its step, writes a checkpoint and exits" in text
    assert read_stop_request(tmp_path) == f"{name} to the supervisor (pid {os.getpid()})"
    steps = metrics_lines(tmp_path)
    assert f"stopped after step {steps} (checkpoint {tmp_path / 'checkpoints' / f'step_{steps:08d}'})" in text
    assert "continue with: dsv4rl train recipe=x run.dir=y resume=auto" in text
    assert "stopped" in text and "failed" not in text
    assert sup.children[0].proc.returncode == -signal.SIGTERM  # the engine, stopped after the trainer
    assert_all_gone(written_pids(tmp_path))


def test_preempt_a_second_signal_stops_every_process_at_once(tmp_path) -> None:
    sup, out = supervisor(tmp_path, mode="stubborn")  # never reaches a boundary that stops it
    stop_file = tmp_path / "STOP"
    thread = signal_when(
        lambda: metrics_lines(tmp_path) >= 2, signal.SIGTERM, signal.SIGTERM, between=stop_file.exists
    )
    assert sup.run() == 130
    thread.join()
    text = out.getvalue()
    assert "SIGTERM received during the graceful stop: stopping every process now" in text
    assert "interrupted" in text and "continue with" not in text
    assert_all_gone(written_pids(tmp_path))


def test_preempt_grace_timeout_stops_every_process(tmp_path) -> None:
    sup, out = supervisor(tmp_path, mode="stubborn", stop_grace_s=0.5)
    thread = signal_when(lambda: metrics_lines(tmp_path) >= 2, signal.SIGUSR1)
    assert sup.run() == 130
    thread.join()
    assert (
        "the trainer did not stop within run.stop_grace_s=0.5 s: stopping every process now" in out.getvalue()
    )
    assert_all_gone(written_pids(tmp_path))


def test_preempt_before_the_trainer_started_stops_at_once(tmp_path) -> None:
    """Nothing to save while the trainer still loads: the signal stops everything, as Ctrl-C does."""
    sup, out = supervisor(tmp_path, mode="starting")
    thread = signal_when(lambda: (tmp_path / "trainer.pids").exists(), signal.SIGTERM)
    assert sup.run() == 130
    thread.join()
    text = out.getvalue()
    assert "SIGTERM received: stopping every process" in text
    assert not (tmp_path / "STOP").exists()
    assert_all_gone(written_pids(tmp_path))


def test_preempt_engines_may_exit_while_the_trainer_checkpoints(tmp_path) -> None:
    """Slurm signals every process of the job: the engines may be gone before the trainer's checkpoint is
    written. Only the trainer's exit decides."""
    sup, out = supervisor(tmp_path, mode="outlives_engine")

    def kill_engine() -> None:
        wait_for(tmp_path / "STOP", timeout_s=60)
        os.kill(int(wait_for(tmp_path / "engine-0.pids").split()[0]), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while sup.children[0].proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        (tmp_path / "engine-gone").write_text("")

    killer = threading.Thread(target=kill_engine)
    killer.start()
    thread = signal_when(lambda: metrics_lines(tmp_path) >= 2, signal.SIGTERM)
    assert sup.run() == STOPPED_EXIT
    thread.join()
    killer.join()
    text = out.getvalue()
    assert "engine-0 was killed by SIGKILL (exit code -9) while the run stops" in text
    assert "stopped after step" in text
    assert_all_gone(written_pids(tmp_path))


def test_preempt_a_rollout_node_serves_until_the_trainer_stopped(tmp_path) -> None:
    console, out = capture()
    sup = rollout_node(tmp_path, console)
    sup.stop_grace_s = 60.0
    serving = []

    def stop() -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        wait_for(tmp_path / "STOP")  # the request reaches node 0's trainer through the shared run dir
        time.sleep(0.2)  # several polls: still serving
        serving.append(sup.children[0].proc.poll() is None)
        write_marker(tmp_path / "DONE", "stopped")  # node 0, once its trainer stopped

    thread = in_watch_loop(out, stop)
    assert sup.run() == STOPPED_EXIT
    thread.join()
    assert serving == [True]
    text = out.getvalue()
    assert "SIGTERM received: the trainer (node 0) stops at its next step boundary" in text
    assert "the trainer stopped at a step boundary" in text
    assert_all_gone(written_pids(tmp_path))


def test_preempt_node_0_writes_a_stopped_marker(tmp_path) -> None:
    sup, _ = supervisor(tmp_path, done_marker=DoneMarker(tmp_path))
    thread = signal_when(lambda: metrics_lines(tmp_path) >= 1, signal.SIGTERM)
    assert sup.run() == STOPPED_EXIT
    thread.join()
    assert '"status": "stopped"' in (tmp_path / "DONE").read_text()


def test_preempt_resumed_console_continues_from_the_resumed_step(tmp_path) -> None:
    """Without a terminal, a resumed run prints its own steps only: from the one after the checkpoint."""
    lines = [f'{{"step": {step}, "reward_mean": 0.{step}, "time_step_s": 1.0}}\n' for step in range(1, 7)]
    (tmp_path / "metrics.jsonl").write_text("".join(lines))  # the stopped run got to step 6, saved step 4
    sup, out = supervisor(tmp_path, mode="resumed", steps=6)
    assert sup.run() == 0
    text = out.getvalue()
    printed = [line.split(" |")[0] for line in text.splitlines() if line.startswith("step ")]
    assert printed == ["step 5/6", "step 6/6"]
    assert sup.progress.step == 6
