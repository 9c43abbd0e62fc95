"""A test hook: make one process hang on purpose, so the hang watchdog can be tested end to end.

`DSV4RL_INJECT_HANG="<process>:<phase>[:<step>]"` (several separated by commas) blocks a process forever
when it enters that phase (at that step, when given). `<process>` is a process name (`engine-0`,
`trainer-rank1`) or a supervisor child's name, which covers all its ranks (`trainer`). Phases are the
heartbeat phases: the trainer loop's `rollout`, `reward`, `train`, `sync`, `eval`, `checkpoint` (ranks
other than 0 `wait_batch` for rank 0's rollout and reward); an engine's `generate` (a batch of requests)
and `weight_update`. Examples: `trainer:train:2`,
`engine-0:generate`. Never set it outside tests: the run then stops after `run.step_timeout_s`.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

from dsv4rl.faults.files import owned_by

HANG_ENV = "DSV4RL_INJECT_HANG"


@dataclass(frozen=True)
class HangPoint:
    process: str
    phase: str
    step: int | None = None

    def matches(self, process: str, phase: str, step: int | None) -> bool:
        return (
            owned_by(process, self.process)
            and phase == self.phase
            and (self.step is None or self.step == step)
        )


def parse_hang_points(text: str) -> list[HangPoint]:
    """`"trainer:train:2,engine-0:generate"` -> hang points; ValueError names a malformed entry."""
    points = []
    for entry in filter(None, (part.strip() for part in text.split(","))):
        fields = entry.split(":")
        if len(fields) not in (2, 3) or not all(fields[:2]):
            raise ValueError(f"{HANG_ENV}: {entry!r} is not <process>:<phase>[:<step>]")
        try:
            step = int(fields[2]) if len(fields) == 3 else None
        except ValueError:
            raise ValueError(f"{HANG_ENV}: {entry!r}: the step must be an integer") from None
        points.append(HangPoint(fields[0], fields[1], step))
    return points


def maybe_hang(process: str, phase: str, step: int | None = None) -> None:
    """Block forever if `DSV4RL_INJECT_HANG` names this process, phase and step."""
    text = os.environ.get(HANG_ENV)
    if not text or not any(p.matches(process, phase, step) for p in parse_hang_points(text)):
        return
    at = "" if step is None else f" at step {step}"
    print(f"{HANG_ENV}: {process} hangs in {phase}{at} (test hook)", file=sys.stderr, flush=True)
    block_forever()


def block_forever() -> None:
    while True:
        time.sleep(3600)
