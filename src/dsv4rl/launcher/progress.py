"""What the supervisor shows while a run trains: it tails the trainer's metrics.jsonl.

The trainer writes one JSON object per step (keys below; `step` counts completed steps from 1). The
supervisor renders a progress bar, the latest metrics and where the time went, or one line per step
when there is no terminal, and a summary at the end.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from rich.console import Group, RenderableType
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from dsv4rl.metrics import pace

PHASES = ("rollout", "reward", "wait_rollout", "train", "sync", "verify", "eval")
# With algo.max_staleness >= 1 a step's rollout and reward ran while earlier steps trained: not in its time.
BACKGROUND = ("rollout", "reward")
SHOWN = (
    ("reward_mean", "reward"),
    ("reward_std", "reward std"),
    ("reward/zero_std_fraction", "flat groups"),  # groups whose rewards are all equal: no gradient
    ("response_len_mean", "response len"),
    ("logprob_abs_diff", "|logprob diff|"),
    ("kl", "kl"),
    ("entropy", "entropy"),
    ("grad_norm", "grad norm"),
    ("sync_bytes", "sync bytes"),
    ("time_step_s", "step s"),
)


class MetricsTail:
    """Reads the complete lines appended to a JSONL file since the last call (the file may not exist yet).

    A rewritten file (the trainer truncates it to the checkpoint's step on resume) is detected by
    checking that the last line read is still where it was; then reading restarts from the top and
    `rewritten` is set for the caller to reset what it accumulated.

    `only_new`: the lines already in the file when the tail is made (an earlier run's, in a run dir that
    is resumed) are never returned, even when a rewrite puts them back: what the caller shows and sums
    up is this run's steps only.
    """

    def __init__(self, path: Path, *, only_new: bool = False):
        self.path = Path(path)
        self._offset = 0  # just after the last complete line consumed
        self._last = b""  # that line, with its newline
        self.bad_lines = 0
        self.rewritten = False
        self._earlier: set[int] = set()  # hashes of the lines that were there before (only_new)
        if only_new:
            with contextlib.suppress(OSError):
                self._earlier = {hash(line) for line in self.path.read_bytes().split(b"\n") if line.strip()}

    def read_new(self) -> list[dict[str, Any]]:
        self.rewritten = False
        try:
            with self.path.open("rb") as f:
                if self._last:
                    f.seek(self._offset - len(self._last))
                    if f.read(len(self._last)) != self._last:
                        self.rewritten = True
                        self._offset, self._last = 0, b""
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n")
        if end < 0:
            return []  # nothing new, or a line still being written
        complete = data[: end + 1]
        self._offset += len(complete)
        lines = complete.split(b"\n")[:-1]
        self._last = lines[-1] + b"\n"
        records = []
        for line in lines:
            if not line.strip() or hash(line) in self._earlier:
                continue
            try:
                record = json.loads(line)
            except ValueError:
                self.bad_lines += 1
                continue
            if isinstance(record, dict):
                records.append(record)
        return records


def _fmt(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
        return f"{value:.3e}"
    return f"{value:.4g}"


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


class RunProgress:
    """Accumulates step records: latest values, time totals per phase."""

    def __init__(self, total_steps: int):
        self.total_steps = total_steps
        self.records = 0
        self.first: dict[str, Any] = {}
        self.last: dict[str, Any] = {}
        self.time = dict.fromkeys((*PHASES, "step"), 0.0)
        self.step_seconds: list[float] = []  # this run's time_step_s, for the pace
        self.overlapped = False  # async rollouts: rollout and reward ran in the background
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("steps"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            auto_refresh=False,
        )
        self._task = self.progress.add_task("train", total=total_steps or None)

    @property
    def first_step(self) -> int | None:
        """The first step recorded (after a resume: the one after the checkpoint's)."""
        step = self.first.get("step")
        return step if isinstance(step, int) else None

    @property
    def step(self) -> int:
        return int(max(self.records, self.last.get("step", 0) or 0))

    def add(self, record: dict[str, Any]) -> None:
        self.first = self.first or record
        self.records += 1
        self.last = record
        self.overlapped = self.overlapped or "async_overlap_s" in record
        for phase in (*PHASES, "step"):
            value = record.get(f"time_{phase}_s")
            if isinstance(value, int | float):
                self.time[phase] += value
                if phase == "step":
                    self.step_seconds.append(float(value))
        self.progress.update(self._task, completed=self.step)

    def shares(self) -> dict[str, float]:
        """Seconds per phase that took any, plus `other` (step time not in a named phase). With async
        rollouts, rollout and reward are listed as "(background)" and not counted in the steps' time."""
        named = {p: self.time[p] for p in PHASES if self.time[p] > 0 or p in ("rollout", "train", "sync")}
        in_steps = sum(v for p, v in named.items() if not (self.overlapped and p in BACKGROUND))
        other = max(0.0, self.time["step"] - in_steps)
        if self.overlapped:
            named = {(f"{p} (background)" if p in BACKGROUND else p): v for p, v in named.items()}
        named["other"] = other
        return named

    def line(self, record: dict[str, Any]) -> str:
        """One plain line per step, for logs and pipes."""
        total = f"/{self.total_steps}" if self.total_steps else ""
        parts = [f"step {record.get('step', self.records)}{total}"]
        for key, label in SHOWN:
            if key in record and key != "sync_bytes":
                parts.append(f"{label} {_fmt(record[key])}")
        step_s = record.get("time_step_s")
        if isinstance(step_s, int | float) and step_s > 0:
            background = "async_overlap_s" in record
            split = " ".join(
                f"{p}{' (background)' if background and p in BACKGROUND else ''} "
                f"{100 * record.get(f'time_{p}_s', 0) / step_s:.0f}%"
                for p in PHASES
                if isinstance(record.get(f"time_{p}_s"), int | float) and record[f"time_{p}_s"] > 0
            )
            parts.append(f"({split})")
        going = pace(self.step_seconds, self.step, self.total_steps or None)
        if going is not None:
            parts.append(going.describe())
        return " | ".join(parts)

    def _metrics_table(self) -> Table:
        table = Table(title=f"step {self.last.get('step', '-')}", show_header=False, box=None, padding=(0, 2))
        table.add_column("metric", style="cyan")
        table.add_column("value", justify="right")
        for key, label in SHOWN:
            if key in self.last:
                value = self.last[key]
                table.add_row(label, _bytes(value) if key == "sync_bytes" else _fmt(value))
        return table

    def time_table(self, title: str = "time") -> Table:
        shares = self.shares()
        total = sum(v for phase, v in shares.items() if not phase.endswith("(background)"))
        table = Table(title=title, box=None, padding=(0, 2))
        table.add_column("phase", style="cyan")
        table.add_column("seconds", justify="right")
        table.add_column("share", justify="right")
        for phase, seconds in shares.items():
            table.add_row(phase, f"{seconds:.1f}", f"{100 * seconds / total:.0f}%" if total else "-")
        return table

    def renderable(self) -> RenderableType:
        grid = Table.grid(padding=(0, 4))
        grid.add_row(self._metrics_table(), self.time_table())
        return Group(self.progress.get_renderable(), grid if self.records else "[dim]waiting for step 1...")

    def summary(self, run_dir: Path, status: str) -> RenderableType:
        head = Table.grid(padding=(0, 2))
        head.add_column(style="bold")
        head.add_column()
        total = f" / {self.total_steps}" if self.total_steps else ""
        head.add_row("status", status)
        first = self.first_step
        resumed = f" (steps {first}-{self.step} in this run: resumed)" if (first or 0) > 1 else ""
        head.add_row("steps", f"{self.step}{total}{resumed}")
        if "reward_mean" in self.last:
            head.add_row("final reward", _fmt(self.last["reward_mean"]))
        head.add_row("time in steps", f"{self.time['step']:.1f} s")
        head.add_row("run dir", str(run_dir))
        return Group(head, self.time_table("where the time went") if self.records else "")
