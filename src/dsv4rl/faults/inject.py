"""Test hooks: make one process hang or die on purpose at a precise point, so that the hang watchdog and
the failure reports can be tested end to end.

`DSV4RL_INJECT_HANG="<process>:<phase>[:<step>]"` (several separated by commas) blocks a process forever
when it reaches that point (at that step, when given); `DSV4RL_INJECT_KILL` (same syntax) kills it there
with SIGKILL, as the out-of-memory killer or a lost machine would: no exception, no crash report.
`<process>` is a process name (`engine-0`, `trainer-rank1`) or a supervisor child's name, which covers
all its ranks (`trainer`). The points:
- the heartbeat phases: the trainer loop's `rollout`, `reward`, `train`, `sync`, `eval`, `checkpoint`
  (ranks other than 0 `wait_batch` for rank 0's rollout and reward), at the loop's step;
- an engine's pieces of work: `generate` (a batch of requests) and `weight_update` (an update request
  arrived; the trainer's broadcast of its tensors is under way, the engine has not joined it), and, inside
  a weight update, `weight_broadcast` (the engine's receive of the broadcast has begun: tensors are in
  flight). An engine's step is its weight-update session, counted from 0 (the push at start): the
  trainer's step in a run that did not resume.
`DSV4RL_INJECT_FAIL` (same syntax) raises `InjectedFault` there instead: the process lives on and handles
it as any error of that work (an engine answers the request with a failure, as one whose load failed).
Examples: `trainer:train:2`, `engine-0:generate`, `DSV4RL_INJECT_KILL=engine-0:weight_broadcast:2`,
`DSV4RL_INJECT_FAIL=engine-0:weight_broadcast:3`. Never set them outside tests.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from dsv4rl.faults.files import owned_by

HANG_ENV = "DSV4RL_INJECT_HANG"
KILL_ENV = "DSV4RL_INJECT_KILL"
FAIL_ENV = "DSV4RL_INJECT_FAIL"


class InjectedFault(RuntimeError):
    """A failure made on purpose at a named point (`DSV4RL_INJECT_FAIL`)."""


@dataclass(frozen=True)
class HangPoint:
    """Where a process is made to fail (hang or die): a process, a phase or point, a step or any."""

    process: str
    phase: str
    step: int | None = None

    def matches(self, process: str, phase: str, step: int | None) -> bool:
        return (
            owned_by(process, self.process)
            and phase == self.phase
            and (self.step is None or self.step == step)
        )


def parse_hang_points(text: str, env: str = HANG_ENV) -> list[HangPoint]:
    """`"trainer:train:2,engine-0:generate"` -> points; ValueError names a malformed entry and `env`."""
    points = []
    for entry in filter(None, (part.strip() for part in text.split(","))):
        fields = entry.split(":")
        if len(fields) not in (2, 3) or not all(fields[:2]):
            raise ValueError(f"{env}: {entry!r} is not <process>:<phase>[:<step>]")
        try:
            step = int(fields[2]) if len(fields) == 3 else None
        except ValueError:
            raise ValueError(f"{env}: {entry!r}: the step must be an integer") from None
        points.append(HangPoint(fields[0], fields[1], step))
    return points


def _named(env: str, process: str, phase: str, step: int | None) -> bool:
    text = os.environ.get(env)
    return bool(text) and any(p.matches(process, phase, step) for p in parse_hang_points(text, env))


def maybe_hang(
    process: str, phase: str, step: int | None = None, *, settle: Callable[[], object] | None = None
) -> None:
    """Die if `DSV4RL_INJECT_KILL`, raise `InjectedFault` if `DSV4RL_INJECT_FAIL`, block forever if
    `DSV4RL_INJECT_HANG` names this process, point and step. `settle` runs before a kill (the heartbeat's
    flush: its file then says where the process died, as it would for a process killed some time into the
    phase)."""
    at = "" if step is None else f" at step {step}"
    if _named(KILL_ENV, process, phase, step):
        print(f"{KILL_ENV}: {process} is killed in {phase}{at} (test hook)", file=sys.stderr, flush=True)
        if settle is not None:
            settle()
        os.kill(os.getpid(), signal.SIGKILL)
        block_forever()  # SIGKILL is delivered before kill() returns; never reached
    if _named(FAIL_ENV, process, phase, step):
        print(f"{FAIL_ENV}: {process} fails in {phase}{at} (test hook)", file=sys.stderr, flush=True)
        raise InjectedFault(f"{FAIL_ENV}: {process} fails in {phase}{at} (test hook)")
    if _named(HANG_ENV, process, phase, step):
        print(f"{HANG_ENV}: {process} hangs in {phase}{at} (test hook)", file=sys.stderr, flush=True)
        block_forever()


def block_forever() -> None:
    while True:
        time.sleep(3600)
