import math

import pytest

from dsv4rl.train.lr_schedule import LearningRateSchedule


def test_warmup_then_constant() -> None:
    schedule = LearningRateSchedule(warmup=4)
    assert [schedule(step) for step in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_decays_to_the_floor_at_the_last_step() -> None:
    schedule = LearningRateSchedule(warmup=2, total=13, kind="cosine", min_ratio=0.1)
    assert schedule(0) == 0.5
    assert schedule(2) == 1.0
    assert math.isclose(schedule(7), 0.55)  # half way through the decay
    assert math.isclose(schedule(12), 0.1)
    values = [schedule(step) for step in range(2, 13)]
    assert values == sorted(values, reverse=True)


def test_unknown_schedule_is_refused() -> None:
    with pytest.raises(ValueError, match="constant or cosine"):
        LearningRateSchedule(0, 10, kind="linear")
