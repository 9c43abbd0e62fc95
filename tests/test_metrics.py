"""The pace of a run (steps per second and its estimated end) and durations as people read them."""

from __future__ import annotations

import pytest

from dsv4rl.metrics import Pace, fmt_duration, pace


def test_pace_is_the_mean_of_the_recent_steps_and_the_end_counts_the_steps_left() -> None:
    assert pace([], 0, 10) is None and pace([0.0], 1, 10) is None  # nothing timed yet
    going = pace([100.0] * 5 + [2.0] * 10, done=15, planned=115)
    assert going == Pace(0.5, 200.0)
    assert going.describe() == "2 s/step, ends in ~3 min"  # below a step a second: per step, as tqdm
    assert pace([0.25], done=3, planned=None) == Pace(4.0, None)
    assert pace([0.25], done=3, planned=None).describe() == "4 steps/s"
    assert pace([2.0], done=12, planned=10).describe() == "2 s/step"  # done: no end to give
    assert pace([90.0], done=1, planned=3).describe() == "90 s/step, ends in ~3 min"


@pytest.mark.parametrize(("seconds", "said"), [(-1, "0 s"), (42.4, "42 s"), (600, "10 min"), (5400, "90 min"),
                                              (9000, "2.5 h")])  # fmt: skip
def test_durations_read_as_estimates(seconds: float, said: str) -> None:
    assert fmt_duration(seconds) == said
