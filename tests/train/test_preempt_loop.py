"""The loop's graceful stop: asked during a step (a rank's signal, or the STOP file), the loop finishes that
step, checkpoints it (once), records the stop and leaves; with two ranks both agree at the same boundary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dsv4rl.train.loop as loop_module
from dsv4rl.config.schema import Config
from dsv4rl.faults.stop import StopSignals, request_stop
from dsv4rl.train.loop import RLLoop


class Backend:
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.saved: list[str] = []

    def save_checkpoint(self, path: str, extra: dict) -> None:
        self.saved.append(Path(path).name)
        Path(path).mkdir(parents=True)
        (Path(path) / "trainer_state.pt").write_bytes(b"")


def loop_for(tmp_path: Path, monkeypatch, *, checkpoint_every: int, ask) -> tuple[RLLoop, Backend, list]:
    """A world of 1 whose steps only record themselves; `ask(loop, step)` runs inside each step."""
    monkeypatch.setattr(loop_module.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(loop_module.dist, "get_world_size", lambda: 1)
    cfg = Config()
    cfg.train.steps, cfg.train.checkpoint_every = 8, checkpoint_every
    backend = Backend()
    signals = StopSignals()  # not installed: the test sets its reason as a handler would
    loop = RLLoop(cfg, backend, tmp_path, None, weight_sync=None, stop_signals=signals)
    steps: list[int] = []
    monkeypatch.setattr(loop, "sync_weights", lambda version: None)

    def step(number: int) -> None:
        steps.append(number)
        ask(loop, number)

    monkeypatch.setattr(loop, "step", step)
    return loop, backend, steps


def test_preempt_a_signal_mid_step_checkpoints_that_step_and_stops(tmp_path, monkeypatch) -> None:
    def ask(loop: RLLoop, step: int) -> None:
        if step == 3:
            loop.stop.signals.reason = "SIGTERM to trainer pid 1"

    loop, backend, steps = loop_for(tmp_path, monkeypatch, checkpoint_every=2, ask=ask)
    loop.run()
    assert steps == [1, 2, 3] and loop.stopped_at == 3
    assert backend.saved == ["step_00000002", "step_00000003"]  # the due one, then the stop's
    record = json.loads((tmp_path / "STOPPED").read_text())
    assert record["step"] == 3 and record["reason"] == "SIGTERM to trainer pid 1"
    assert record["checkpoint"] == str(tmp_path / "checkpoints" / "step_00000003")


def test_preempt_the_stop_file_at_a_checkpointed_step_saves_nothing_twice(tmp_path, monkeypatch) -> None:
    def ask(loop: RLLoop, step: int) -> None:
        if step == 4:
            request_stop(tmp_path, "SIGUSR1 to the supervisor")

    loop, backend, steps = loop_for(tmp_path, monkeypatch, checkpoint_every=2, ask=ask)
    loop.run()
    assert steps == [1, 2, 3, 4] and backend.saved == ["step_00000002", "step_00000004"]
    assert json.loads((tmp_path / "STOPPED").read_text())["reason"] == "SIGUSR1 to the supervisor"


def test_preempt_before_the_first_step_leaves_without_a_checkpoint(tmp_path, monkeypatch) -> None:
    request_stop(tmp_path, "SIGTERM")
    loop, backend, steps = loop_for(tmp_path, monkeypatch, checkpoint_every=0, ask=lambda loop, step: None)
    loop.run()
    assert steps == [] and backend.saved == [] and loop.stopped_at == 0
    assert json.loads((tmp_path / "STOPPED").read_text())["checkpoint"] is None


AGREE = r"""
import os, sys
import torch.distributed as dist
from dsv4rl.faults.stop import StopSignals
from dsv4rl.train.preempt import BoundaryStop
dist.init_process_group("gloo")
rank = dist.get_rank()
signals = StopSignals()
stop = BoundaryStop(sys.argv[1], rank, signals=signals)
answers = [stop.requested()]
if rank == 1:
    signals.reason = "SIGTERM to trainer pid 7"  # only rank 1 was signalled
answers.append(stop.requested())
print(rank, answers, flush=True)
dist.destroy_process_group()
"""


def test_preempt_every_rank_agrees_at_the_same_boundary(tmp_path) -> None:
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env["OMP_NUM_THREADS"] = "1"
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", AGREE, str(tmp_path)], env=env, stdout=subprocess.PIPE, text=True
            )
        )
    outputs = sorted(proc.communicate(timeout=120)[0].strip() for proc in procs)
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    assert outputs == [
        "0 [None, 'another trainer rank was asked to stop']",
        "1 [None, 'SIGTERM to trainer pid 7']",
    ]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(autouse=True)
def _no_heartbeat(monkeypatch) -> None:
    """The loop tells the hang watchdog its phases; no supervisor here."""
    monkeypatch.setattr(loop_module.heartbeat, "enter", lambda *args, **kwargs: None)
