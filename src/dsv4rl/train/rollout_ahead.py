"""One-step-off-policy rollouts (`algo.async_rollout`): step k+1's batch is generated while step k trains.

The loop's order becomes: take batch k -> start rollout k+1 in the background -> train on batch k -> wait
for rollout k+1 -> push weights k -> (eval) -> next step. So the engines generate batch k+1 entirely with
weights k-1 (they never change mid-batch: the push waits for the rollout), each sample is one step stale,
the same in every run of a seed, and a step takes about max(rollout, train) + sync instead of their sum.
The loss corrects for the staleness with TIS/MIS (validation requires one of them): with one update per
batch the old log-probs are the current policy's (version k-1) and the rollout log-probs version k-2's.

The background thread runs rank 0's rollout and reward (the driver's event loop and clients, which the main
thread does not touch while a rollout is in flight: the push, the checks and the eval come after `wait`).
A finished batch waiting to be trained is part of a checkpoint (`pending` / `restore`), so a resumed run
trains on the batch the uninterrupted run would have.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Callable
from dataclasses import dataclass

from dsv4rl.train.batch import TrainBatch

Collect = Callable[[int], tuple[TrainBatch, dict[str, float]]]


@dataclass
class Rollout:
    """A step's batch, its rollout metrics, and when it was generated (monotonic seconds)."""

    step: int
    batch: TrainBatch
    metrics: dict[str, float]
    started: float = 0.0
    finished: float = 0.0


class RolloutAhead:
    """Generates the next step's batch on a background thread; `collect(step)` does the work."""

    def __init__(self, collect: Collect) -> None:
        self.collect = collect
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsv4rl-rollout-ahead")
        self._future: cf.Future[Rollout] | None = None
        self._step: int | None = None

    def _run(self, step: int) -> Rollout:
        started = time.monotonic()
        batch, metrics = self.collect(step)
        return Rollout(step, batch, metrics, started, time.monotonic())

    def submit(self, step: int) -> None:
        if self._future is not None:
            raise RuntimeError(f"the rollout of step {self._step} is still pending; take it first")
        self._step, self._future = step, self._pool.submit(self._run, step)

    def restore(self, rollout: Rollout) -> None:
        """A finished rollout from a checkpoint: the next `take` returns it."""
        done: cf.Future[Rollout] = cf.Future()
        done.set_result(rollout)
        self._step, self._future = rollout.step, done

    def wait(self) -> Rollout | None:
        """Block until the pending rollout is done (re-raising its error); None when nothing is pending."""
        return None if self._future is None else self._future.result()

    @property
    def pending(self) -> Rollout | None:
        """The finished rollout not yet taken (what a checkpoint keeps); None when none or still running."""
        if self._future is None or not self._future.done() or self._future.exception() is not None:
            return None
        return self._future.result()

    def take(self, step: int) -> Rollout:
        """The rollout of `step` (generated now when none is pending); nothing is pending after."""
        if self._future is None:
            self.submit(step)
        if self._step != step:
            raise RuntimeError(f"the pending rollout is for step {self._step}, not {step}")
        future, self._future, self._step = self._future, None, None
        return future.result()

    def close(self, wait: bool = True) -> None:
        """`wait=False` after a failure: a rollout still running on a stuck engine must not hold the exit."""
        self._pool.shutdown(wait=wait, cancel_futures=True)


def overlap_seconds(rollout: Rollout, train_start: float, train_end: float) -> float:
    """How long the rollout ran while the trainer trained (both in monotonic seconds)."""
    return max(0.0, min(rollout.finished, train_end) - max(rollout.started, train_start))
