"""Reading a run's `metrics.jsonl` into per-key columns, tolerant of a run that is still writing it.

Pure functions, no plotting: the plots and the summary both work from a `MetricsTable`. Lines that
cannot be used are skipped, never silently: each one leaves a note (with its line number) that the
command prints and the summary lists. Only a file without a single usable line is an error.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from dsv4rl.metrics import TIME_PHASES

METRICS_FILE = "metrics.jsonl"
_PHASE_KEY = re.compile(r"^time_(?P<phase>.+)_s$")


class ReportError(ValueError):
    """The run dir cannot be reported on (missing, no metrics file, no complete line)."""


@dataclass
class MetricsTable:
    """The usable step lines of one metrics file, sorted by step, plus what was skipped and why."""

    path: Path
    rows: list[dict[str, object]]
    notes: list[str] = field(default_factory=list)
    partial_last_line: bool = False  # the writer was (or stopped) in the middle of a line

    @property
    def steps(self) -> list[int]:
        return [int(row["step"]) for row in self.rows]

    def has(self, key: str) -> bool:
        """Whether any step holds a number for `key`."""
        return any(_number(row.get(key)) is not None for row in self.rows)

    def column(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of the steps that hold a finite number for `key` (eval keys: some steps only)."""
        steps: list[int] = []
        values: list[float] = []
        for row in self.rows:
            value = _number(row.get(key))
            if value is not None:
                steps.append(int(row["step"]))
                values.append(value)
        return steps, values

    def keys(self) -> list[str]:
        """Every key of any row, in first-seen order."""
        seen: dict[str, None] = {}
        for row in self.rows:
            seen.update(dict.fromkeys(row))
        return list(seen)

    def keys_with_prefix(self, prefix: str) -> list[str]:
        return [key for key in self.keys() if key.startswith(prefix) and self.has(key)]

    def time_phases(self) -> list[str]:
        """Phases with a `time_<phase>_s` key (not the whole step): the loop's own order, then the rest."""
        found = [m["phase"] for key in self.keys() if (m := _PHASE_KEY.match(key)) and m["phase"] != "step"]
        found = [phase for phase in found if self.has(f"time_{phase}_s")]
        return [p for p in TIME_PHASES if p in found] + sorted(p for p in found if p not in TIME_PHASES)


def _number(value: object) -> float | None:
    """A finite float, or None (`MetricsWriter` writes NaN/inf as null; bools are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _parse_line(text: str) -> dict[str, object] | str:
    """The step object of one line, or why it is unusable."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"not JSON ({exc.msg})"
    if not isinstance(obj, dict):
        return f"a JSON {type(obj).__name__}, not an object"
    step = obj.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        return "no integer 'step'"
    return obj


def parse_metrics_text(text: str, path: Path) -> MetricsTable:
    """Split and parse a metrics file's text; skipped lines leave notes.

    The last line is partial when the text does not end with a newline (the writer appends each line
    with its newline in one write, so a run caught mid-write, or killed, leaves such a tail): it is
    skipped with a note even when it happens to parse. A repeated step keeps its last line (a file
    appended to by a second run that was not resumed), with a note.
    """
    lines = text.split("\n")
    tail = lines.pop()  # "" when the text ends with a newline
    notes: list[str] = []
    by_step: dict[int, dict[str, object]] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        parsed = _parse_line(line)
        if isinstance(parsed, str):
            notes.append(f"line {number} skipped: {parsed}: {_clip(line)}")
            continue
        step = int(parsed["step"])
        if step in by_step:
            notes.append(f"line {number} repeats step {step}: the later line is used")
        by_step[step] = parsed
    partial = bool(tail.strip())
    if partial:
        notes.append(
            f"line {len(lines) + 1} skipped: partial last line (no newline yet; the run may still be "
            f"writing it): {_clip(tail)}"
        )
    rows = [by_step[step] for step in sorted(by_step)]
    return MetricsTable(path=path, rows=rows, notes=notes, partial_last_line=partial)


def _clip(line: str, width: int = 60) -> str:
    line = line.strip()
    return repr(line if len(line) <= width else line[: width - 3] + "...")


def load_metrics_table(run_dir: str | Path) -> MetricsTable:
    """The metrics of `run_dir`; `ReportError` when there is nothing to report on."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"run dir {str(run_dir)!r} does not exist (or is not a directory)")
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise ReportError(
            f"{str(run_dir)!r} has no {METRICS_FILE}: not a run dir, or the run has not finished a step yet"
        )
    table = parse_metrics_text(path.read_text(errors="replace"), path)
    if not table.rows:
        why = "; ".join(table.notes) if table.notes else "the file is empty"
        raise ReportError(f"{path} has no complete step line ({why})")
    return table


def rolling_mean(values: list[float], window: int) -> list[float]:
    """Mean of each value and up to `window - 1` values before it (short windows at the start)."""
    means: list[float] = []
    total = 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        means.append(total / min(index + 1, window))
    return means


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None
