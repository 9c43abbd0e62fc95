"""The staleness bound a recipe sets (`algo.max_staleness`, or `algo.async_rollout`) and the staleness a step
reports, counted from each sample's first token."""

from __future__ import annotations

import pytest

from dsv4rl.algo.staleness import admission_capacity, staleness_bound, staleness_metrics, tis_on, too_stale
from dsv4rl.config.schema import AlgoConfig, TISConfig


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


def test_tis_unset_corrects_off_policy_runs_only_where_mis_does_not() -> None:
    algo = AlgoConfig()
    assert algo.tis.enabled is None and not tis_on(algo)  # synchronous: the loss as it always was
    algo.max_staleness = 2
    assert tis_on(algo)
    algo.mis.enabled = True
    assert not tis_on(algo)
    algo.tis.enabled = True
    assert tis_on(algo)
    assert not tis_on(AlgoConfig(async_rollout=True, tis=TISConfig(enabled=False)))


def test_admission_lets_no_more_groups_start_than_the_next_k_plus_1_steps_train() -> None:
    # K = 2, 4 prompts a step, engines on version 0: 12 groups may start
    assert admission_capacity(2, 0, 4, accepted=0, running=0) == 12
    assert admission_capacity(2, 0, 4, accepted=3, running=9) == 0
    # a push (version 1) makes room for one more step's groups
    assert admission_capacity(2, 1, 4, accepted=3, running=9) == 4
    # a group the filter rejected is neither accepted nor running: its place goes to a new one
    assert admission_capacity(2, 1, 4, accepted=3, running=8) == 5
    assert admission_capacity(0, 3, 4, accepted=20, running=0) == 0  # never negative


def test_a_group_too_stale_is_more_than_k_versions_behind_the_trained_weights() -> None:
    assert not too_stale("3", trained_version=5, bound=2)
    assert too_stale("2", trained_version=5, bound=2)
    assert not too_stale("default", trained_version=5, bound=2)  # an engine's initial version: fresh
    assert not too_stale("", trained_version=5, bound=0)


def test_oversampling_runs_more_groups_for_a_filter_that_keeps_a_share() -> None:
    # K = 2, 4 prompts a step, nothing accepted yet: twice the 12 groups may run
    assert admission_capacity(2, 0, 4, accepted=0, running=0, oversample=2.0) == 24
    assert admission_capacity(2, 0, 4, accepted=0, running=24, oversample=2.0) == 0
    # kept groups count whole: 10 accepted leave room for 2, so 4 running at factor 2
    assert admission_capacity(2, 0, 4, accepted=10, running=0, oversample=2.0) == 4
    assert admission_capacity(2, 0, 4, accepted=0, running=0, oversample=1.5) == 18
