"""Earlier attempts of a run, kept: what a new attempt in the same run dir would cut or remove is copied
to `<run_dir>/attempts/<n>/` first.

A new attempt (a resume, or a fresh start with `resume=auto` when no checkpoint was saved) cuts
`metrics.jsonl` back to the step it continues from and clears the last attempt's crash reports, notices,
stack dumps and records (OUTCOME, STOPPED, FAILED_PUSH) so that they never describe the new one. Those are
what a person needs to learn why the earlier attempt ended, so node 0's launcher archives them before
anything is cleared; logs are appended to and stay where they are. `dsv4rl report` reads the attempts.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from dsv4rl.faults.files import CRASH, NOTICE, STACKS, fault_file
from dsv4rl.faults.run_outcome import OUTCOME_FILE, RunOutcome, read_run_outcome

ATTEMPTS_DIR = "attempts"
METRICS_FILE = "metrics.jsonl"
RECORDS = (OUTCOME_FILE, "STOPPED", "FAILED_PUSH")  # the run dir's records of how an attempt ended
FAULT_KINDS = (CRASH, NOTICE, STACKS)


@dataclass(frozen=True)
class Attempt:
    number: int
    path: Path
    steps: tuple[int, int] | None  # the first and last step its metrics.jsonl held
    outcome: RunOutcome | None

    def line(self) -> str:
        """`attempt 1: steps 1-141, crashed at step 141 (root cause: ...)`."""
        steps = f"steps {self.steps[0]}-{self.steps[1]}" if self.steps else "no step"
        ended = self.outcome.sentence() if self.outcome else "how it ended was not recorded"
        return f"attempt {self.number}: {steps}, {ended}"


def _fault_files(log_dir: Path) -> list[Path]:
    found: list[Path] = []
    for kind in FAULT_KINDS:
        found += sorted(log_dir.glob(fault_file("", kind, "*").name))
    return found


def archive_attempt(run_dir: Path | str) -> Path | None:
    """Copy the earlier attempt's metrics, records and fault files to `attempts/<n>/` (the next number);
    None when the run dir holds none (a first attempt)."""
    run_dir = Path(run_dir)
    logs = run_dir / "logs"
    kept = [run_dir / name for name in (METRICS_FILE, *RECORDS) if (run_dir / name).is_file()]
    faults = _fault_files(logs) if logs.is_dir() else []
    if not kept and not faults:
        return None
    root = run_dir / ATTEMPTS_DIR
    number = 1 + max((int(p.name) for p in root.glob("*") if p.name.isdigit()), default=0)
    target = root / str(number)
    (target / "logs").mkdir(parents=True)
    for path in kept:
        shutil.copy2(path, target / path.name)
    for path in faults:
        shutil.copy2(path, target / "logs" / path.name)
    return target


def _step_range(metrics: Path) -> tuple[int, int] | None:
    steps = []
    try:
        for line in metrics.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut by a crash
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                steps.append(record["step"])
    except OSError:
        return None
    return (min(steps), max(steps)) if steps else None


def earlier_attempts(run_dir: Path | str) -> list[Attempt]:
    """The run's archived attempts, oldest first."""
    root = Path(run_dir) / ATTEMPTS_DIR
    numbered = sorted((int(p.name), p) for p in root.glob("*") if p.name.isdigit() and p.is_dir())
    return [Attempt(n, p, _step_range(p / METRICS_FILE), read_run_outcome(p)) for n, p in numbered]
