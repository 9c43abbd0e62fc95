"""A graceful stop (preemption): the request, a trainer rank's own signals, and the record of the stop.

- The request is `<run_dir>/STOP`. A node supervisor writes it on its first SIGTERM or SIGUSR1, a batch
  script's trap can write it (`launch/slurm/dapo_math_4node.sbatch`), and so can a user (`touch STOP`):
  trainer rank 0 reads it at every step boundary. A file, not a signal, because it reaches trainer rank 0
  from any node sharing the run dir and never meets torchrun. Node 0's launcher removes an earlier one.
- A trainer rank's own signals: SIGTERM or SIGUSR1 sent straight to a rank (Slurm's `--signal` without
  `B:`, a preemption's SIGTERM to every process of the job) ask the same. After the first, SIGTERM's
  default action is back, so a second SIGTERM kills the rank at once; a second SIGUSR1 does the same.
- The record is `<run_dir>/STOPPED`, written by trainer rank 0 once the checkpoint is complete: the step,
  the checkpoint and why. The supervisor reads it to exit with `STOPPED_EXIT` and say how to resume.

Every rank agrees on the stop at the same step boundary (`dsv4rl.train.preempt`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from pathlib import Path
from types import FrameType
from typing import Any

from dsv4rl.faults.files import read_json, write_json_atomic

STOP_FILE = "STOP"
STOPPED_FILE = "STOPPED"
STOPPED_EXIT = 75  # EX_TEMPFAIL: stopped on request at a step boundary; `resume=auto` continues
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def stop_path(run_dir: Path | str) -> Path:
    return Path(run_dir) / STOP_FILE


def stopped_path(run_dir: Path | str) -> Path:
    return Path(run_dir) / STOPPED_FILE


def request_stop(run_dir: Path | str, reason: str) -> Path:
    """Ask the trainer to stop at its next step boundary (any node, any process)."""
    path = stop_path(run_dir)
    record = {"reason": reason, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}
    write_json_atomic(path, record, durable=False)
    return path


def read_stop_request(run_dir: Path | str) -> str | None:
    """Why a stop was asked for, or None when nobody asked; an empty or hand-written STOP counts too."""
    path = stop_path(run_dir)
    if not path.exists():
        return None
    record = read_json(path) or {}
    return str(record.get("reason") or f"{path} exists")


def clear_stop_files(run_dir: Path | str) -> None:
    """An earlier run's request and record (node 0's launcher, before anything starts)."""
    for path in (stop_path(run_dir), stopped_path(run_dir)):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def write_stopped(run_dir: Path | str, step: int, checkpoint: str | None, reason: str) -> None:
    record = {"step": step, "checkpoint": checkpoint, "reason": reason, "time": time.time()}
    write_json_atomic(stopped_path(run_dir), record)


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns


class StoppedRecord:
    """`<run_dir>/STOPPED` as one supervisor sees it: only a record written after it started counts."""

    def __init__(self, run_dir: Path | str) -> None:
        self.path = stopped_path(run_dir)
        self._initial = _identity(self.path)

    def read(self) -> dict[str, Any] | None:
        if _identity(self.path) in (None, self._initial):
            return None
        return read_json(self.path)


class StopSignals:
    """A trainer rank's stop request by signal; `reason` is None until one came. Install it from the main
    thread; the handler only takes note, the loop acts at its next step boundary."""

    def __init__(self) -> None:
        self.reason: str | None = None

    def install(self) -> StopSignals:
        from dsv4rl.faults.stacks import install_beside_dump

        signal.signal(signal.SIGTERM, self._handle)
        install_beside_dump(self._handle)  # SIGUSR1 still dumps the stacks first
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.reason is not None:  # the second: at once, as the signal's default action would
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self.reason = f"{name} to trainer pid {os.getpid()}"
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM kills even inside C code
