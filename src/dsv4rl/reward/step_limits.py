"""One step's reward scoring under its two limits, so that a reward that hangs stops the run in its first
step, loudly, instead of training on zeros for as long as batch x timeout_s.

- `reward.max_timeout_fraction`: a function whose calls timed out on more than this fraction of the step's
  samples stops the run as soon as that many have timed out; the step's other calls are cancelled (with
  one worker and a function that always hangs, waiting for the rest would cost every call its timeout).
  The allowance counts the samples of the step's rounds so far (dynamic sampling adds rounds), as the
  check at the end of the step (`combine.check_timeout_fraction`) does.
- `reward.step_timeout_s`: the scoring a round has left once its last sample is back (what
  `time_reward_s` measures) must end within this; past it the run stops naming the function with the most
  calls unfinished. It is timed from there, not from the round's start: generation may rightly take long.

Each scorer reports its calls as they start and end (`FunctionWatch.call`); the first limit passed sets
`tripped` to its message, and `RewardSet.score_group` raises it as a `RewardError` in every group of the
round, cancelling their calls (the trainer's crash report and log then carry it).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dsv4rl.reward.results import TIMED_OUT

if TYPE_CHECKING:
    from dsv4rl.reward.results import FnSpec

# What the messages suggest, in the order worth trying
TIMEOUT_FIX = (
    "fix what hangs in the function; or raise its timeout_s (reward.fns[].timeout_s, or reward.timeout_s "
    "for every function) if its calls need longer; or raise reward.max_timeout_fraction if some timeouts "
    "are expected (reward.num_workers runs more calls at once: it shortens a slow step, not a call)"
)
DEADLINE_FIX = (
    "make it faster, add reward.num_workers (sync functions run that many calls at once; async ones "
    "reward.async_concurrency), or raise reward.step_timeout_s (0: no limit; keep it below "
    "run.step_timeout_s, the hang watchdog, which would stop the run first without naming the function)"
)


def timeouts_message(
    spec: FnSpec, timed_out: int, samples: int, max_fraction: float, step: int | None, early: bool = False
) -> str:
    """Why a function's timeouts stop the run: the function, its timeout, how many, and the fix; `early`:
    the step's other calls were cancelled for it."""
    of_step = f"of step {step}" if step is not None else "this step"
    cancelled = "the step's other calls were cancelled and " if early else ""
    return (
        f"reward function {spec.name!r} ({spec.target}): {timed_out} of the {samples} samples {of_step} "
        f"timed out (no result within timeout_s={spec.timeout_s:g}), more than "
        f"reward.max_timeout_fraction={max_fraction:g} allows ({int(max_fraction * samples)}); {cancelled}"
        f"the run stops rather than train on timeouts: {TIMEOUT_FIX}"
    )


def _timeouts_of(samples: int) -> Callable[[Any], int]:
    return lambda raw: samples if raw is TIMED_OUT else 0


@dataclass
class _Calls:
    """One function's calls in the step: when each unfinished one started, and the samples that timed out."""

    spec: FnSpec
    running: dict[int, float] = field(default_factory=dict)
    timed_out: int = 0  # samples


class StepWatch:
    """A step's reward calls as they run, against `max_timeout_fraction` and `step_timeout_s` (0: off)."""

    def __init__(self, max_timeout_fraction: float = 1.0, step_timeout_s: float = 0.0) -> None:
        self.max_timeout_fraction = max_timeout_fraction
        self.step_timeout_s = step_timeout_s
        self.step: int | None = None
        self.samples = 0  # of the step's rounds so far: 0 until a round begins (no early stop then)
        self.tripped: asyncio.Future | None = None  # its result: the message of the limit passed
        self._calls: dict[str, _Calls] = {}
        self._ids = itertools.count()
        self._deadline: asyncio.TimerHandle | None = None

    def watch(self, spec: FnSpec) -> FunctionWatch:
        return FunctionWatch(self, spec)

    def begin_round(self, step: int, samples: int) -> None:
        """A generation round of `step` with `samples` samples starts (on the event loop that scores it)."""
        loop = asyncio.get_running_loop()
        if step != self.step or self.tripped is None or self.tripped.get_loop() is not loop:
            self.step, self.samples = step, 0
            self.tripped = loop.create_future()
            for calls in self._calls.values():
                calls.timed_out = 0
        self.samples += samples

    def start_deadline(self) -> None:
        """The round's last sample is back: what scoring is left has `step_timeout_s`."""
        self.stop_deadline()
        if self.step_timeout_s > 0 and self.tripped is not None:
            loop = self.tripped.get_loop()
            self._deadline = loop.call_later(self.step_timeout_s, self._overdue, time.monotonic())

    def stop_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    async def call(
        self, spec: FnSpec, awaitable: Awaitable[Any], samples: int, timeouts: Callable[[Any], int] | None
    ) -> Any:
        """`awaitable`'s result, counted: it runs for `samples` samples; `timeouts(result)` of them timed out
        (default: all of them when the result is TIMED_OUT)."""
        calls = self._calls.setdefault(spec.name, _Calls(spec))
        token = next(self._ids)
        calls.running[token] = time.monotonic()
        try:
            raw = await awaitable
        finally:
            calls.running.pop(token, None)
        timed_out = (timeouts or _timeouts_of(samples))(raw)
        if timed_out:
            calls.timed_out += timed_out
            self._check_timeouts(calls)
        return raw

    def _trip(self, message: str) -> None:
        if self.tripped is not None and not self.tripped.done():
            self.tripped.set_result(message)

    def _check_timeouts(self, calls: _Calls) -> None:
        if self.samples and calls.timed_out > self.max_timeout_fraction * self.samples:
            fraction = self.max_timeout_fraction
            self._trip(timeouts_message(calls.spec, calls.timed_out, self.samples, fraction, self.step, True))

    def _overdue(self, since: float) -> None:
        self._deadline = None
        self._trip(self.overdue_message(time.monotonic() - since))

    def overdue_message(self, waited_s: float) -> str:
        """The deadline passed: name the function with the most calls unfinished (then the oldest)."""
        now = time.monotonic()
        busy = [c for c in self._calls.values() if c.running]
        busy.sort(key=lambda c: (len(c.running), now - min(c.running.values())), reverse=True)
        head = (
            f"reward scoring of step {self.step} did not finish within reward.step_timeout_s="
            f"{self.step_timeout_s:g} of its last sample coming back ({waited_s:.0f} s)"
        )
        if not busy:
            return f"{head}; {DEADLINE_FIX}"
        slowest, others = busy[0], busy[1:]
        spec = slowest.spec
        oldest = now - min(slowest.running.values())
        rest = "; also unfinished: " + ", ".join(f"{c.spec.name!r} {len(c.running)}" for c in others)
        return (
            f"{head}: the slowest is reward function {spec.name!r} ({spec.target}), {len(slowest.running)} "
            f"calls unfinished, the oldest for {oldest:.0f} s (timeout_s={spec.timeout_s:g} each)"
            f"{rest if others else ''}; {DEADLINE_FIX}"
        )


class FunctionWatch:
    """One function's view of the step's `StepWatch`; without one (a scorer used alone) it only awaits."""

    def __init__(self, step: StepWatch | None = None, spec: FnSpec | None = None) -> None:
        self.step, self.spec = step, spec

    async def call(
        self, awaitable: Awaitable[Any], samples: int = 1, timeouts: Callable[[Any], int] | None = None
    ) -> Any:
        if self.step is None:
            return await awaitable
        return await self.step.call(self.spec, awaitable, samples, timeouts)


NO_WATCH = FunctionWatch()
