"""`dsv4rl align --attribute` in the launcher: which features apply (decided by validation), one align run
per engine start, stale files removed, the runs' measurements merged into one report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from dsv4rl.algo.attribution import (
    SEQUENCES_FILE,
    configuration_name,
    current_engine_flags,
    engine_report_file,
)
from dsv4rl.config.choices import AlignFeature
from dsv4rl.config.compose import ConfigError, compose
from dsv4rl.config.schema import Config
from dsv4rl.launcher.align_view import render_attribution
from dsv4rl.launcher.attribute_run import applicable_features, engine_runs, resolve_features, run_attribution

F = AlignFeature
ROUNDING = {F.kv_fp8, F.bf16_weights, F.bf16_activations, F.mhc_tf32, F.router_bf16_input}


def tiny(*overrides: str) -> Config:
    return compose("tiny_arith", ["engine.numerics=sglang", *overrides])


def test_every_feature_that_validates_applies() -> None:
    features, skipped = applicable_features(tiny())
    assert set(features) == {F.routing_replay, F.indexer_replay, F.fp32_lm_head} | ROUNDING
    assert "quant=none" in skipped["act_fp8"]  # no FP8 linears to quantize the inputs of
    features, skipped = applicable_features(tiny("quant=fp8_mxfp4"))
    assert F.act_fp8 in features and not skipped


def test_trainer_rounding_is_not_offered_against_an_exact_engine() -> None:
    features, skipped = applicable_features(compose("tiny_arith", []))
    assert set(features) == {F.routing_replay, F.indexer_replay, F.fp32_lm_head}
    assert all("exact" in skipped[f.value] for f in ROUNDING)


def test_dapo_math_attributes_what_its_layout_allows() -> None:
    features, skipped = applicable_features(compose("dapo_math", []))
    assert features == [F.routing_replay, F.fp32_lm_head]
    assert "attention TP size 1" in skipped["indexer_replay"]
    assert "megatron" in skipped["kv_fp8"]


def test_a_named_subset_must_validate() -> None:
    with pytest.raises(ConfigError, match="act_fp8"):
        resolve_features(tiny("align.attribute=[act_fp8]"))
    with pytest.raises(ConfigError, match=r"align.attribute=\[\]"):
        resolve_features(tiny("align.attribute=[]"))
    assert resolve_features(tiny("align.attribute=[kv_fp8,routing_replay]")) == (
        [F.kv_fp8, F.routing_replay],
        {},
    )


def test_one_run_per_engine_start_with_the_replays_captured() -> None:
    features = [F.routing_replay, F.fp32_lm_head, F.kv_fp8]
    runs = engine_runs(tiny("train.numerics.kv_fp8=true"), features)
    assert [flags for flags, _ in runs] == [frozenset(), frozenset({F.fp32_lm_head})]
    for flags, run in runs:
        assert run.engine.fp32_lm_head == (F.fp32_lm_head in flags)
        assert run.algo.routing_replay and not run.algo.indexer_replay  # the engines capture their experts
        assert not run.train.numerics.kv_fp8  # installed per configuration by the trainer
        assert run.align.attribute == features and current_engine_flags(run) == flags
    # without the fp32 LM head among the features: one engine start, the recipe's head kept
    runs = engine_runs(tiny("engine.fp32_lm_head=true"), [F.routing_replay, F.kv_fp8])
    assert (
        len(runs) == 1 and runs[0][1].engine.fp32_lm_head and current_engine_flags(runs[0][1]) == frozenset()
    )


def fake_measurement(run: Config, report_path: Path, calls: list) -> dict:
    """What one align run writes: a summary per configuration of its engine start."""
    from dsv4rl.algo.attribution import configuration_grid, engine_groups

    flags = current_engine_flags(run)
    assert report_path.name == engine_report_file(flags)
    assert not (report_path.parent / SEQUENCES_FILE).exists() or calls  # stale sequences removed first
    (report_path.parent / SEQUENCES_FILE).write_text("{}")
    calls.append(flags)
    configurations = {}
    for configuration in engine_groups(configuration_grid(run.align.attribute))[flags]:
        mean = 1e-3 / (1 + 3 * len(configuration))
        configurations[configuration_name(configuration)] = {
            "mean_abs_diff": mean, "p99_abs_diff": 5 * mean, "max_abs_diff": 9 * mean, "tokens": 50,
            "worst_tokens": [{"abs_diff": 9 * mean, "trainer_logprob": -1.0, "rollout_logprob": -1.1,
                              "context": "1+2=", "token": "3"}],
        }  # fmt: skip
    return {"sequences": 10, "configurations": configurations}


def test_the_runs_are_merged_into_one_report(tmp_path: Path) -> None:
    cfg = tiny(f"run.dir={tmp_path}")
    (tmp_path / SEQUENCES_FILE).write_text("stale")
    (tmp_path / "attribute-none.json").write_text("stale")
    features = [F.routing_replay, F.fp32_lm_head, F.kv_fp8]
    calls: list = []
    report = run_attribution(
        cfg, features, {"act_fp8": "why"}, lambda run, path: fake_measurement(run, path, calls)
    )
    assert calls == [frozenset(), frozenset({F.fp32_lm_head})]
    assert report["baseline"]["mean_abs_diff"] == 1e-3 and report["aligned"]["mean_abs_diff"] == 1e-4
    assert [row["name"] for row in report["features"]] == ["routing_replay", "fp32_lm_head", "kv_fp8"]
    assert report["sequences"] == 10 and report["engine_starts"] == 2 and report["skipped_features"]
    assert json.loads((tmp_path / "attribute.json").read_text()) == report
    console = Console(width=80, record=True)  # a narrow terminal: every number whole
    render_attribution(report, console)
    text = console.export_text()
    assert "baseline (all off)" in text and "aligned (all on)" in text and "10x smaller" in text
    kv = next(line for line in text.splitlines() if line.strip().startswith("kv_fp8"))
    assert kv.split()[1:] == ["0.00025", "0.0013", "0.0023", "75%", "0.00014", "+4e-05"]
    assert "not attributed: act_fp8" in text and "'1+2='" in text
