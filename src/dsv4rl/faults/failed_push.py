"""A weight push that failed on engines which cannot take another (their post-processing is not
idempotent): the record of it, the exit code that asks for a requeue, and the bound on requeues.

Such engines hold a partial update nobody can repair (`dsv4rl.sync.weight_sync`), so the run cannot go
on with them; a new launch can, with fresh engines and `resume=auto` from the last checkpoint. So:

- trainer rank 0 writes `<run_dir>/FAILED_PUSH` (the step whose weights failed, the checkpoint a resume
  takes, why) before it exits with the error;
- the node supervisor, seeing its trainer fail after such a record appeared, ends the run with
  `FAILED_PUSH_EXIT` (`dsv4rl.launcher.supervisor`);
- node 0's launcher counts the requeue in `<run_dir>/REQUEUES` and allows it while the count stays within
  `cluster.max_requeues` (`decide_requeue`): the record then says `"requeue": true` and the launcher exits
  `FAILED_PUSH_EXIT`; past the bound it says `false` and the launcher exits 1, for a person to look;
- the sbatch script requeues the job when the record says so (`launch/slurm/dapo_math_4node.sbatch`).

Node 0's launcher removes an earlier record before anything starts; the count stays with the run dir.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsv4rl.faults.files import read_json, write_json_atomic

FAILED_PUSH_FILE = "FAILED_PUSH"
REQUEUES_FILE = "REQUEUES"
# EX_PROTOCOL: the engines' side of the weight update broke; distinct from 75 (stopped on request) so that a
# batch script tells "fresh engines, then resume" from "resume" and from any other failure (1).
FAILED_PUSH_EXIT = 76


def failed_push_path(run_dir: Path | str) -> Path:
    return Path(run_dir) / FAILED_PUSH_FILE


def requeues_path(run_dir: Path | str) -> Path:
    return Path(run_dir) / REQUEUES_FILE


def write_failed_push(run_dir: Path | str, step: int, checkpoint: str | None, reason: str) -> Path:
    """Trainer rank 0, before it exits with the push's error: what failed and where a resume starts."""
    path = failed_push_path(run_dir)
    record = {"step": step, "checkpoint": checkpoint, "reason": reason, "time": time.time()}
    write_json_atomic(path, record)
    return path


def clear_failed_push(run_dir: Path | str) -> None:
    """An earlier launch's record (node 0's launcher, before anything starts); the count stays."""
    with contextlib.suppress(FileNotFoundError):
        failed_push_path(run_dir).unlink()


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns


class FailedPushRecord:
    """`<run_dir>/FAILED_PUSH` as one supervisor sees it: only a record written after it started counts."""

    def __init__(self, run_dir: Path | str) -> None:
        self.path = failed_push_path(run_dir)
        self._initial = _identity(self.path)

    def read(self) -> dict[str, Any] | None:
        if _identity(self.path) in (None, self._initial):
            return None
        return read_json(self.path)


def requeue_count(run_dir: Path | str) -> int:
    """Requeues after failed pushes this run dir has had (0 when none)."""
    record = read_json(requeues_path(run_dir)) or {}
    count = record.get("failed_push", 0)
    return count if isinstance(count, int) and count >= 0 else 0


@dataclass(frozen=True)
class Requeue:
    """Node 0's decision after a failed push: whether the job may run again, and the count it makes."""

    allowed: bool
    count: int  # requeues after failed pushes, this one included when allowed
    max_requeues: int
    record: dict[str, Any]  # FAILED_PUSH as written back

    @property
    def exit_code(self) -> int:
        return FAILED_PUSH_EXIT if self.allowed else 1

    def message(self, resume_hint: str) -> str:
        step, checkpoint = self.record.get("step"), self.record.get("checkpoint")
        start = f"from {checkpoint}" if checkpoint else "from step 0 (no checkpoint yet)"
        if self.allowed:
            return (
                f"the weight push of step {step} failed on engines that cannot take another: requeue "
                f"{self.count} of cluster.max_requeues={self.max_requeues} (exit {FAILED_PUSH_EXIT}); the "
                f"next launch starts fresh engines and resumes {start}: {resume_hint}"
            )
        return (
            f"the weight push of step {step} failed on engines that cannot take another, and this run dir "
            f"was requeued {self.count} times after failed pushes already (cluster.max_requeues="
            f"{self.max_requeues}): not again. Read the trainer's error above, fix its cause, then run "
            f"{resume_hint} (resumes {start}); raise cluster.max_requeues or delete {REQUEUES_FILE} in the "
            "run dir to allow more"
        )


def decide_requeue(run_dir: Path | str, max_requeues: int) -> Requeue:
    """Count this failed push's requeue in `REQUEUES` when the count allows one, and write the decision
    into `FAILED_PUSH` (`"requeue"`, `"requeues"`, `"max_requeues"`), which the batch script reads."""
    count = requeue_count(run_dir)
    allowed = count < max_requeues
    if allowed:
        count += 1
        write_json_atomic(requeues_path(run_dir), {"failed_push": count, "time": time.time()})
    record = read_json(failed_push_path(run_dir)) or {}
    record.update(requeue=allowed, requeues=count, max_requeues=max_requeues)
    write_json_atomic(failed_push_path(run_dir), record)
    return Requeue(allowed, count, max_requeues, record)
