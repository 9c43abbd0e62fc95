"""RolloutAhead: the next step's batch generated on a thread of its own, handed over once, kept for a
checkpoint; and the overlap the loop reports."""

from __future__ import annotations

import threading

import pytest
import torch

from dsv4rl.train.batch import TrainBatch
from dsv4rl.train.rollout_ahead import Rollout, RolloutAhead, overlap_seconds


def batch(step: int) -> TrainBatch:
    ids = torch.full((2, 3), step)
    zeros = torch.zeros(2, 2)
    return TrainBatch(ids, zeros, torch.zeros(2), zeros)


def test_the_next_rollout_runs_in_the_background_and_is_taken_once() -> None:
    release = threading.Event()
    threads = []

    def collect(step: int):
        threads.append(threading.current_thread().name)
        release.wait(5)
        return batch(step), {"reward_mean": step / 10}

    ahead = RolloutAhead(collect)
    try:
        ahead.submit(2)
        assert ahead.pending is None  # still running
        with pytest.raises(RuntimeError, match="step 2 is still pending"):
            ahead.submit(3)
        release.set()
        done = ahead.wait()
        assert done.step == 2 and done.finished >= done.started and ahead.pending is done
        taken = ahead.take(2)
        assert taken is done and ahead.wait() is None and ahead.pending is None
        assert threads == ["dsv4rl-rollout-ahead_0"]
        third = ahead.take(3)  # nothing pending: generated now
        assert third.metrics == {"reward_mean": 0.3}
    finally:
        ahead.close()


def test_a_restored_rollout_is_the_next_one_taken_and_a_wrong_step_is_refused() -> None:
    ahead = RolloutAhead(lambda step: pytest.fail("a restored rollout must not be generated again"))
    saved = Rollout(5, batch(5), {"reward_mean": 0.5})
    ahead.restore(saved)
    assert ahead.pending is saved
    with pytest.raises(RuntimeError, match="for step 5, not 6"):
        ahead.take(6)
    ahead.close()


def test_errors_of_the_rollout_reach_the_loop() -> None:
    def collect(step: int):
        raise ValueError(f"engine gone at step {step}")

    ahead = RolloutAhead(collect)
    ahead.submit(4)
    with pytest.raises(ValueError, match="engine gone at step 4"):
        ahead.wait()
    assert ahead.pending is None
    ahead.close(wait=False)


def test_overlap() -> None:
    rollout = Rollout(3, batch(3), {}, started=10.0, finished=14.0)
    assert overlap_seconds(rollout, 11.0, 13.0) == 2.0  # inside the training
    assert overlap_seconds(rollout, 12.0, 20.0) == 2.0
    assert overlap_seconds(rollout, 15.0, 16.0) == 0.0
