"""Failures of the tools themselves (and of an environment), not of the model: counted, logged, recorded
and bounded.

A call fails on the tool's side when the tool raised, or ran past its `timeout_s` (the rollout's per-call
limit). What a tool answers on purpose with `ToolResult(error=True)` because the model's input was bad (the
model's code raised, an argument made no sense) is the model's error, part of what it learns: it counts in
`tool/errors` only. In `rollout.mode=env` a step of the environment that raised is the environment's
failure (counted under the name `env`; the trajectory ends with finish reason `abort`).

- The model reads a short error result: the exception's type and the first line of its message, never the
  traceback (`ToolFailure.model_text`).
- The trainer's log gets the traceback (`FailureLog`): the first few failures of each tool and exception
  type in full, the rest as one line with a count every `COUNT_EVERY` failures and at the end of a step,
  so a tool that raises on every call does not flood the log.
- The call's rollout record carries `exception: {type, message, traceback}`.
- When more than `rollout.max_tool_error_fraction` of a step's calls of one tool failed, `ToolFailureError`
  stops the run naming the tool, its last traceback and the fix (`StepFailures`). It is raised as soon as
  the fraction can no longer end the step under the limit: a step's calls are bounded (a trajectory makes at
  most `max_tool_calls` calls, or `max_turns` environment steps), so a tool that fails on every call stops
  the run early in its first step, not after it.
"""

from __future__ import annotations

import logging
import traceback as tb
from collections import Counter
from dataclasses import dataclass

from dsv4rl.samples import CallCounts, Trajectory

log = logging.getLogger(__name__)

ENV_NAME = "env"  # the name an environment's failures are counted under (tool/env/...)
FULL_TRACEBACKS = 3  # failures logged with their traceback, per tool and exception type, per run
COUNT_EVERY = 100  # past those: one line per this many failures of a tool (and one at the end of a step)
MODEL_MESSAGE_CHARS = 200  # the most of an exception's message the model reads


class ToolFailureError(RuntimeError):
    """More of a step's calls of one tool (or environment steps) failed than
    rollout.max_tool_error_fraction allows; the message names the tool, its last traceback and the fix."""


@dataclass
class ToolFailure:
    """One call on which the tool failed. `what` names it in messages: `tool 'lookup'`, `environment ...`."""

    name: str  # the tool's name; ENV_NAME for an environment
    what: str
    error_type: str
    message: str
    traceback: str = ""  # "" for a timeout: the rollout cancelled the call, nothing raised inside it
    timed_out: bool = False

    @classmethod
    def raised(cls, name: str, what: str, error: BaseException) -> ToolFailure:
        return cls(name, what, type(error).__name__, str(error), "".join(tb.format_exception(error)))

    @classmethod
    def timeout(cls, name: str, what: str, seconds: float) -> ToolFailure:
        message = f"no result within timeout_s={seconds:g} (the rollout's per-call limit)"
        return cls(name, what, "TimeoutError", message, timed_out=True)

    @property
    def headline(self) -> str:
        """`RuntimeError: the service is down` (the type alone when the message is empty)."""
        return f"{self.error_type}: {self.message}" if self.message else self.error_type

    def model_text(self) -> str:
        """The error result the model reads: short and informative, never the traceback."""
        first = self.message.strip().splitlines()[0] if self.message.strip() else ""
        if len(first) > MODEL_MESSAGE_CHARS:
            first = first[: MODEL_MESSAGE_CHARS - 3] + "..."
        return f"error: {self.error_type}: {first}" if first else f"error: {self.error_type}"

    def record(self) -> dict[str, str]:
        """The `exception` of the call's rollout record."""
        return {"type": self.error_type, "message": self.message, "traceback": self.traceback}


class FailureLog:
    """The trainer's log of tool failures, rate-limited: the first `full` of each (tool, exception type)
    with their traceback, then a line with a count every `every` failures of a tool and at `flush` (the
    end of a step). Lives as long as the rollout, so a tool failing on every step is shown in full once."""

    def __init__(self, full: int = FULL_TRACEBACKS, every: int = COUNT_EVERY, logger: logging.Logger = log):
        self.full = full
        self.every = max(1, every)
        self.logger = logger
        self.shown: Counter[tuple[str, str]] = Counter()
        self.quiet: dict[str, Counter[str]] = {}  # per tool: failures since its last line, by type
        self.last: dict[str, ToolFailure] = {}

    def add(self, failure: ToolFailure, where: str, consequence: str) -> None:
        """Log `failure` (at `where`: the problem and turn; `consequence`: what the trajectory did)."""
        key = (failure.name, failure.error_type)
        if self.shown[key] < self.full:
            self.shown[key] += 1
            verb = "timed out" if failure.timed_out else "raised"
            last = "" if self.shown[key] < self.full else f"; further {failure.error_type} of it are counted"
            detail = f"\n{failure.traceback.rstrip()}" if failure.traceback else ""
            self.logger.warning(
                "%s %s %s (%s; %s%s)%s",
                failure.what,
                verb,
                failure.headline,
                where,
                consequence,
                last,
                detail,
            )
            return
        self.quiet.setdefault(failure.name, Counter())[failure.error_type] += 1
        self.last[failure.name] = failure
        if sum(self.quiet[failure.name].values()) >= self.every:
            self._count_line(failure.name, "")

    def flush(self) -> None:
        """One line per tool with failures not logged yet (the end of a step)."""
        for name in list(self.quiet):
            self._count_line(name, " this step")

    def _count_line(self, name: str, when: str) -> None:
        counts = self.quiet.pop(name)
        last = self.last[name]
        kinds = ", ".join(f"{kind} x{n}" for kind, n in counts.most_common())
        self.logger.warning(
            "%s failed %d more times%s (%s), not logged in full; last: %s",
            last.what,
            sum(counts.values()),
            when,
            kinds,
            last.headline,
        )


class StepFailures:
    """One generation round's calls per tool and their failures, against
    `rollout.max_tool_error_fraction`. `calls_left`: the most calls the round's trajectories can still
    make (each ran call and each finished trajectory's unused budget take from it), so `check` knows when
    a tool's fraction can no longer end under the limit."""

    def __init__(self, max_fraction: float, calls_left: int, failure_log: FailureLog):
        self.max_fraction = max_fraction
        self.calls_left = calls_left
        self.log = failure_log
        self.counts: dict[str, CallCounts] = {}
        self.last: dict[str, ToolFailure] = {}
        self.stopped: str | None = None  # the message the round stopped with: nothing more is logged

    def ran(
        self, trajectory: Trajectory, name: str, failure: ToolFailure | None, where: str, consequence: str
    ) -> None:
        """A call of `name` ran for `trajectory` (counted on both); `failure` when the tool failed."""
        self.calls_left = max(0, self.calls_left - 1)
        for counts in (
            self.counts.setdefault(name, CallCounts()),
            trajectory.by_tool.setdefault(name, CallCounts()),
        ):
            counts.calls += 1
            if failure is not None:
                counts.timeouts += int(failure.timed_out)
                counts.exceptions += int(not failure.timed_out)
        if failure is not None:
            self.last[name] = failure
            if self.stopped is None:  # the calls still in flight when the round stopped are not logged
                self.log.add(failure, where, consequence)

    def release(self, unused: int) -> None:
        """A trajectory ended with `unused` calls of its budget left."""
        self.calls_left = max(0, self.calls_left - max(0, unused))

    def check(self) -> None:
        """ToolFailureError when a tool's failures are more than the fraction allows of the most calls
        it can reach this round (its calls so far plus what is left; at the end: exactly its calls)."""
        if self.stopped is not None:
            raise ToolFailureError(self.stopped)
        for name, counts in self.counts.items():
            reachable = counts.calls + self.calls_left
            if counts.failed and counts.failed > self.max_fraction * reachable:
                self.log.flush()
                self.stopped = self._message(counts, self.last[name])
                raise ToolFailureError(self.stopped)

    def _message(self, counts: CallCounts, last: ToolFailure) -> str:
        limit = f"rollout.max_tool_error_fraction={self.max_fraction:g}"
        if self.calls_left:
            share = (
                f"{counts.failed} of its {counts.calls} calls so far this step failed; with at most "
                f"{self.calls_left} more calls this step its share cannot end under {limit}"
            )
        else:
            share = (
                f"{counts.failed} of its {counts.calls} calls this step failed "
                f"({counts.failed / counts.calls:.0%}, more than {limit})"
            )
        kinds = f"{counts.exceptions} raised, {counts.timeouts} timed out"
        env = last.name == ENV_NAME
        slow = "" if env else ", raise its timeout_s in rollout.tools if it is only slow"
        fix = (
            f"fix the {'environment' if env else 'tool'}: these are its own failures, not the model's (a "
            f"bad call from the model is answered with ToolResult(error=True), which does not count){slow}, "
            f"or raise rollout.max_tool_error_fraction to train through them (docs/agents.md)"
        )
        detail = f"\nlast traceback:\n{last.traceback.rstrip()}" if last.traceback else ""
        return f"{last.what}: {share} ({kinds}); last: {last.headline}; {fix}{detail}"
