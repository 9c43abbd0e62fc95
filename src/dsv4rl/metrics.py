"""Per-step metrics: timers for where the time went, and the `metrics.jsonl` every run writes."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

# Keys every step line carries (the supervisor's display and users' scripts rely on them).
STEP_KEYS = (
    "step",
    "reward_mean",
    "reward_std",
    "response_len_mean",
    "logprob_abs_diff",
    "kl",
    "entropy",
    "grad_norm",
    "nonfinite_steps",  # optimizer steps skipped for a NaN/Inf loss or gradient (dsv4rl.train.nonfinite)
    "time_rollout_s",
    "time_reward_s",
    "time_train_s",
    "time_sync_s",
    "time_step_s",
    "sync_bytes",
)
TIME_PHASES = ("rollout", "reward", "train", "sync")
PACE_WINDOW = 10  # steps the pace is measured over: recent enough to follow a run that slows down


@dataclass(frozen=True)
class Pace:
    """How fast a run goes and when it will end, from its recent steps' `time_step_s`."""

    steps_per_s: float
    remaining_s: float | None  # None when the planned step count is unknown

    def describe(self) -> str:
        """`2.5 steps/s, ends in ~3 min`, or `4.1 s/step, ...` under a step a second (as tqdm: it/s, s/it)."""
        per_s = self.steps_per_s
        rate = f"{per_s:.3g} steps/s" if per_s >= 1 else f"{1 / per_s:.3g} s/step"
        if self.remaining_s is None:
            return rate
        return f"{rate}, ends in ~{fmt_duration(self.remaining_s)}" if self.remaining_s > 0 else rate


def pace(
    step_seconds: Sequence[float], done: int, planned: int | None, window: int = PACE_WINDOW
) -> Pace | None:
    """The mean of the last `window` step times; None before the first timed step."""
    recent = [s for s in step_seconds[-window:] if s > 0]
    if not recent:
        return None
    per_step = sum(recent) / len(recent)
    remaining = None if planned is None else max(planned - done, 0) * per_step
    return Pace(1.0 / per_step, remaining)


def fmt_duration(seconds: float) -> str:
    """`42 s`, `12 min`, `1.5 h`: a person's estimate, not a timer."""
    seconds = max(seconds, 0.0)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class StepTimer:
    """Wall-clock seconds per phase of one step: `with timer.phase("rollout"): ...`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._start = time.perf_counter()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def move(self, source: str, target: str, seconds: float) -> None:
        """Count `seconds` of phase `source` as `target`'s (work that overlapped: its tail is `target`'s)."""
        seconds = min(seconds, self.seconds.get(source, 0.0))
        self.seconds[source] = self.seconds.get(source, 0.0) - seconds
        self.seconds[target] = self.seconds.get(target, 0.0) + seconds

    def as_metrics(self) -> dict[str, float]:
        metrics = {f"time_{name}_s": self.seconds.get(name, 0.0) for name in TIME_PHASES}
        for name, seconds in self.seconds.items():
            metrics[f"time_{name}_s"] = seconds
        metrics["time_step_s"] = time.perf_counter() - self._start
        return metrics


def _json_safe(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    """Appends one JSON object per step to `<run_dir>/metrics.jsonl`, flushed at once."""

    def __init__(self, path: str | Path, resume_from_step: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_from_step is not None:
            self._truncate_after(resume_from_step)

    def _truncate_after(self, step: int) -> None:
        """On resume, drop lines of steps the checkpoint does not include, so the file reads as one run."""
        if not self.path.exists():
            return
        kept = [
            line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= step
        ]
        self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, metrics: Mapping[str, object]) -> None:
        missing = [key for key in STEP_KEYS if key not in metrics]
        if missing:
            raise KeyError(f"step metrics lack {missing}")
        line = json.dumps({key: _json_safe(value) for key, value in metrics.items()})
        with self.path.open("a") as handle:
            handle.write(line + "\n")


def read_metrics(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
