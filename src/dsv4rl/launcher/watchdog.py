"""The hang watchdog's judgement: from the heartbeats, is a step stuck, and who did not advance.

Watched are the processes that run the step loop (trainer ranks, the evaluating process). Ranks wait for
the rank furthest behind (in a collective, or for rank 0's batch), so only the ranks furthest behind are
judged: when none of them has made progress (a new phase, an engine's answer) for `run.step_timeout_s`,
the step is stuck. Startup (phase `start`: loading the model, joining the process groups) is not
judged: it may take long, and the engines' startup timeout and the collectives' own timeouts bound it.
The process to blame:
- the rank behind waits on the engines (rollout, offload, sync, eval) and an engine is busy: the engine
  busy the longest (a generate batch or a weight update that never ends);
- otherwise the rank behind; when several are equally far, the lowest (rank 0 drives the step).
Heartbeats from other nodes (shared run dir) count too, so a node whose ranks wait for rank 0's batch
does not judge them alone; their clocks must agree to well within the timeout.
Pure functions over `Beat`s and a clock, so every case is tested without processes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from dsv4rl.faults.heartbeat import Beat

# A step's phases in order; `wait_batch`: the ranks other than 0 wait for rank 0's batch; `verify`: the
# checks after a push (checksums, the log-prob probe on the engines).
PHASE_ORDER = (
    "start", "resume", "rollout", "reward", "offload", "wait_batch", "train", "sync", "verify", "eval",
    "checkpoint", "shutdown",
)  # fmt: skip
# algo.max_staleness >= 1: rank 0 waits for the batch generating in the background, before a step and
# after each train phase; either way it is where rank 0 stands while it has no batch to hand over
SAME_PLACE = {"wait_rollout": "rollout"}
# the trainer waits on the engines there
ENGINE_BOUND = frozenset({"rollout", "wait_rollout", "offload", "sync", "verify", "eval"})
UNJUDGED = frozenset({"start"})


@dataclass(frozen=True)
class Hang:
    stalled: Beat  # the watched process furthest behind, without progress
    stalled_for_s: float
    culprit: Beat  # the process that did not advance: `stalled` or an engine it waits on
    why: str  # how the culprit was chosen, one clause

    def where(self) -> str:
        return where(self.stalled)

    def headline(self, timeout_s: float) -> str:
        return (
            f"hang: no progress for {self.stalled_for_s:.1f} s in phase {where(self.stalled)} "
            f"(run.step_timeout_s={timeout_s:g}): {self.culprit.process} did not advance, {self.why}"
        )


def where(beat: Beat) -> str:
    return beat.phase if beat.step is None else f"{beat.phase} at step {beat.step}"


def describe(beat: Beat, now: float) -> str:
    """`trainer-rank0: train at step 2 for 6.1 s (pid 123)`."""
    state = "busy in " if beat.busy else ""
    return f"{beat.process}: {state}{where(beat)} for {now - beat.since:.1f} s (pid {beat.pid})"


def rank_of(process: str) -> int:
    match = re.search(r"-rank(\d+)$", process)
    return int(match.group(1)) if match else 0


def _position(beat: Beat) -> tuple[int, int]:
    """How far a rank got: (step, phase within the step); unknown phases count as the step's start."""
    phase = SAME_PLACE.get(beat.phase, beat.phase)
    order = PHASE_ORDER.index(phase) if phase in PHASE_ORDER else 0
    return (-1 if beat.step is None else beat.step, order)


def find_hang(watched: Sequence[Beat], servers: Sequence[Beat], timeout_s: float, now: float) -> Hang | None:
    """The hang, if the ranks furthest behind have had no progress for `timeout_s` (0: never)."""
    if timeout_s <= 0 or not watched:
        return None
    lowest = min(_position(b) for b in watched)
    behind = sorted((b for b in watched if _position(b) == lowest), key=lambda b: rank_of(b.process))
    stalled_for = now - max(b.last_progress for b in behind)
    if behind[0].phase in UNJUDGED or stalled_for < timeout_s:
        return None
    stalled = behind[0]
    busy = [s for s in servers if s.busy]
    if stalled.phase in ENGINE_BOUND and busy:
        engine = min(busy, key=lambda s: s.since)
        why = (
            f"busy in {engine.phase} for {now - engine.since:.1f} s while {stalled.process} waits on it in "
            f"{where(stalled)}"
        )
        return Hang(stalled, stalled_for, engine, why)
    why = f"stuck in {where(stalled)}"
    ahead = [b for b in watched if _position(b) != lowest]
    if ahead:
        listed = [f"{b.process} in {where(b)}" for b in ahead[:3]] + [f"{len(ahead) - 3} more"] * (
            len(ahead) > 3
        )
        why += f" while the other ranks are further on ({', '.join(listed)})"
    elif len(behind) > 1:
        why += f" (all {len(behind)} ranks are there)"
    if stalled.phase in ENGINE_BOUND and servers:
        why += "; no engine is busy with a request"
    return Hang(stalled, stalled_for, stalled, why)
