"""The staleness bound a recipe sets (`algo.max_staleness`, or `algo.async_rollout`) and the staleness a step
reports, counted from each sample's first token."""

from __future__ import annotations

import pytest

from dsv4rl.algo.staleness import staleness_bound, staleness_metrics
from dsv4rl.config.schema import AlgoConfig


def test_the_bound_is_max_staleness_or_what_async_rollout_means() -> None:
    assert staleness_bound(AlgoConfig()) == 0
    assert staleness_bound(AlgoConfig(async_rollout=True)) == 1
    assert staleness_bound(AlgoConfig(max_staleness=1)) == 1
    assert staleness_bound(AlgoConfig(max_staleness=0)) == 0


def test_staleness_of_the_trained_samples() -> None:
    assert staleness_metrics(["4", "4", "3"], 4) == {
        "staleness/mean": pytest.approx(1 / 3),
        "staleness/max": 1.0,
    }
    assert staleness_metrics(["default"], 0) == {}  # an engine's initial version is not a step
    assert staleness_metrics([], 3) == {}
