"""How a run ended, in its run dir: `<run_dir>/OUTCOME`, written by node 0's launcher once every process
has ended (only it knows whether the run finished, stopped or failed, and why).

`dsv4rl report` and `dsv4rl rollouts` read it, so a run whose trainer crashed reads "crashed at step 12
(root cause ...)" instead of looking like a run still in progress. A new attempt in the same run dir
removes the last one's record before anything starts: while it runs there is none.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dsv4rl.faults.files import read_json, write_json_atomic

OUTCOME_FILE = "OUTCOME"

# The launcher's outcome -> what a person reads. `stopped` covers a preemption's graceful stop (the
# STOPPED record says why); a failed push stops the run for a requeue.
WORDS = {
    "finished": "finished",
    "stopped": "stopped",
    "interrupted": "interrupted",
    "failed_push": "stopped after a failed weight push",
    "failed": "crashed",
    "hung": "hung",
}


@dataclass(frozen=True)
class RunOutcome:
    outcome: str  # finished, stopped, interrupted, failed_push, failed or hung (the supervisor's status)
    last_step: int  # the last step metrics.jsonl holds (0: none)
    exit_code: int
    root_cause: str | None  # one line; None when the run finished
    reason: str | None = None  # a stop's reason (the STOPPED record: "SIGTERM", "STOP file")
    time: float = 0.0

    def sentence(self) -> str:
        """`crashed at step 12 (root cause: trainer: ValueError ...)`, `stopped at step 40 (SIGTERM)`."""
        words = WORDS.get(self.outcome, self.outcome)
        where = f" at step {self.last_step}" if self.last_step else " before step 1"
        if self.outcome == "finished":
            return f"{words}{where}"
        why = f"root cause: {self.root_cause}" if self.root_cause else self.reason
        if self.outcome in ("stopped", "interrupted") and self.reason:
            why = self.reason
        return f"{words}{where}" + (f" ({why})" if why else "")


def outcome_path(run_dir: Path | str) -> Path:
    return Path(run_dir) / OUTCOME_FILE


def write_run_outcome(run_dir: Path | str, outcome: RunOutcome) -> None:
    write_json_atomic(outcome_path(run_dir), {**asdict(outcome), "time": outcome.time or time.time()})


def read_run_outcome(run_dir: Path | str) -> RunOutcome | None:
    """The last attempt's outcome; None while a run is in progress, for runs from before the record, or
    when the file cannot be read (the report then judges from metrics.jsonl alone)."""
    data = read_json(outcome_path(run_dir))
    if not isinstance(data, dict):
        return None
    try:
        return RunOutcome(
            outcome=str(data["outcome"]),
            last_step=int(data["last_step"]),
            exit_code=int(data["exit_code"]),
            root_cause=data.get("root_cause"),
            reason=data.get("reason"),
            time=float(data.get("time", 0.0)),
        )
    except (KeyError, TypeError, ValueError):
        return None


def clear_run_outcome(run_dir: Path | str) -> None:
    with contextlib.suppress(FileNotFoundError):
        outcome_path(run_dir).unlink()
