"""`dsv4rl align --attribute`'s bookkeeping: the configuration grid, its split by engine start, and the
report's JSON shape (the keys the issue names)."""

from __future__ import annotations

import pytest

from dsv4rl.algo.attribution import (
    FEATURE_KEYS,
    attribution_report,
    configuration_grid,
    configuration_name,
    engine_groups,
    parse_configuration,
)
from dsv4rl.config.choices import AlignFeature

F = AlignFeature
THREE = [F.routing_replay, F.fp32_lm_head, F.kv_fp8]


def test_grid_is_baseline_aligned_then_each_alone_and_without() -> None:
    grid = configuration_grid(THREE)
    assert grid[0] == frozenset() and grid[1] == frozenset(THREE)
    for feature in THREE:
        assert frozenset({feature}) in grid and frozenset(THREE) - {feature} in grid
    assert len(grid) == 2 + 2 * 3 and len(set(grid)) == len(grid)


def test_one_feature_repeats_no_configuration() -> None:
    assert configuration_grid([F.kv_fp8, F.kv_fp8]) == [frozenset(), frozenset({F.kv_fp8})]
    with pytest.raises(ValueError, match="at least one feature"):
        configuration_grid([])


def test_only_the_fp32_lm_head_needs_another_engine_start() -> None:
    groups = engine_groups(configuration_grid(THREE))
    assert list(groups) == [frozenset(), frozenset({F.fp32_lm_head})]  # the all-off engine first
    assert all(F.fp32_lm_head not in c for c in groups[frozenset()])
    assert all(F.fp32_lm_head in c for c in groups[frozenset({F.fp32_lm_head})])
    assert sum(len(g) for g in groups.values()) == len(configuration_grid(THREE))
    trainer_only = engine_groups(configuration_grid([F.routing_replay, F.kv_fp8]))
    assert list(trainer_only) == [frozenset()]  # one engine start serves every configuration


def test_names_round_trip_and_every_feature_has_a_recipe_key() -> None:
    for configuration in configuration_grid(list(F)):
        assert parse_configuration(configuration_name(configuration)) == configuration
    assert configuration_name(frozenset()) == "none"
    assert set(FEATURE_KEYS) == set(F)


def summary(mean: float, worst: float = 0.0) -> dict:
    return {"mean_abs_diff": mean, "p99_abs_diff": 4 * mean, "max_abs_diff": 10 * mean, "tokens": 100,
            "p50_abs_diff": mean / 2, "worst_tokens": [{"abs_diff": worst}]}  # fmt: skip


def test_report_has_the_issue_keys_and_what_each_feature_contributes() -> None:
    every = frozenset(THREE)
    results = {
        c: summary(1e-3 * (1 + len(c & {F.fp32_lm_head}) - 0.5 * len(c))) for c in configuration_grid(THREE)
    }
    results[frozenset()] = summary(8e-3, worst=0.1)
    results[every] = summary(1e-3)
    report = attribution_report(THREE, results)
    assert {"baseline", "aligned", "features"} <= set(report)
    for key in ("mean_abs_diff", "p99_abs_diff", "max_abs_diff", "tokens"):
        assert key in report["baseline"] and key in report["aligned"]
    assert report["baseline"]["mean_abs_diff"] == 8e-3 and report["aligned"]["mean_abs_diff"] == 1e-3
    assert report["baseline"]["worst_tokens"] == [{"abs_diff": 0.1}]  # more keys are kept
    assert [row["name"] for row in report["features"]] == [f.value for f in THREE]
    for row, feature in zip(report["features"], THREE, strict=True):
        assert {"name", "mean_abs_diff_alone", "mean_abs_diff_without"} <= set(row)
        assert row["mean_abs_diff_alone"] == results[frozenset({feature})]["mean_abs_diff"]
        assert row["mean_abs_diff_without"] == results[every - {feature}]["mean_abs_diff"]
        assert row["key"] == FEATURE_KEYS[feature]
        alone = row["mean_abs_diff_alone"]
        assert row["gap_closed_alone"] == pytest.approx((8e-3 - alone) / 8e-3)
        assert row["cost_without"] == pytest.approx(row["mean_abs_diff_without"] - 1e-3)
    assert report["reduction"] == {"mean": pytest.approx(8.0), "p99": pytest.approx(8.0)}


def test_a_missing_measurement_is_named() -> None:
    results = {c: summary(1e-3) for c in configuration_grid(THREE)}
    del results[frozenset({F.kv_fp8})]
    with pytest.raises(ValueError, match="kv_fp8"):
        attribution_report(THREE, results)
