"""`dsv4rl align --attribute`: which alignment feature closes how much of the train-vs-rollout gap.

Pure bookkeeping, no model: the configurations to measure (every feature off, every feature on, each
feature alone from all-off and each removed from all-on), which engine start each needs (only
`engine.fp32_lm_head` is an engine flag; the others act in the trainer, so one engine start serves them
all), and the report assembled from one |trainer - engine| summary per configuration. Every
configuration scores the same fixed sequences, so the rows compare the features and nothing else.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from dsv4rl.config.choices import AlignFeature
from dsv4rl.config.schema import Config

Configuration = frozenset[AlignFeature]

# The recipe key each feature sets (the JSON's `key`, and what a user turns on after reading the table).
FEATURE_KEYS: dict[AlignFeature, str] = {
    AlignFeature.routing_replay: "algo.routing_replay",
    AlignFeature.indexer_replay: "algo.indexer_replay",
    AlignFeature.fp32_lm_head: "engine.fp32_lm_head",
    AlignFeature.kv_fp8: "train.numerics.kv_fp8",
    AlignFeature.act_fp8: "train.numerics.act_fp8",
    AlignFeature.bf16_weights: "train.numerics.bf16_weights",
    AlignFeature.bf16_activations: "train.numerics.bf16_activations",
    AlignFeature.mhc_tf32: "train.numerics.mhc_tf32",
    AlignFeature.router_bf16_input: "train.numerics.router_bf16_input",
}
# The trainer's rounding (train.numerics.*): installed per configuration in the trainer's forward.
TRAINER_ROUNDING = frozenset(f for f, key in FEATURE_KEYS.items() if key.startswith("train.numerics."))
# Features that change how the engine is started (the rest are the trainer's, toggled between forwards).
ENGINE_FEATURES = frozenset({AlignFeature.fp32_lm_head})
# Files in the attribution's run dir: the fixed sequences (written by the first engine start's run).
SEQUENCES_FILE = "attribute_sequences.json"
# Keys of one configuration's summary that the report's rows carry.
SUMMARY_KEYS = ("mean_abs_diff", "p99_abs_diff", "max_abs_diff", "tokens")


def configuration_grid(features: Sequence[AlignFeature]) -> list[Configuration]:
    """baseline (none), aligned (all), then each feature alone and each left out, without repeats (with
    one feature, "alone" is "aligned" and "without" is "baseline")."""
    chosen = list(dict.fromkeys(AlignFeature(f) for f in features))
    if not chosen:
        raise ValueError("align --attribute needs at least one feature to toggle")
    every = frozenset(chosen)
    grid = [frozenset(), every]
    for feature in chosen:
        grid += [frozenset({feature}), every - {feature}]
    return list(dict.fromkeys(grid))


def engine_flags(configuration: Configuration) -> frozenset[AlignFeature]:
    """The engine-start features of `configuration`: configurations with equal flags share one engine."""
    return configuration & ENGINE_FEATURES


def engine_groups(grid: Iterable[Configuration]) -> dict[frozenset[AlignFeature], list[Configuration]]:
    """The grid split by engine start, in first-seen order (the all-off engine first)."""
    groups: dict[frozenset[AlignFeature], list[Configuration]] = {}
    for configuration in grid:
        groups.setdefault(engine_flags(configuration), []).append(configuration)
    return groups


def current_engine_flags(cfg: Config) -> frozenset[AlignFeature]:
    """The engine-start features this run's engines were started with, among those being attributed."""
    features = set(cfg.align.attribute or [])
    on = {AlignFeature.fp32_lm_head} if cfg.engine.fp32_lm_head else set()
    return frozenset(on & features & ENGINE_FEATURES)


def engine_report_file(flags: frozenset[AlignFeature]) -> str:
    """Where one engine start's measurements go: `attribute-none.json`, `attribute-fp32_lm_head.json`."""
    return f"attribute-{configuration_name(flags)}.json"


def configuration_name(configuration: Configuration) -> str:
    """A stable name: the features in enum order joined by '+', 'none' for the baseline."""
    return "+".join(f.value for f in AlignFeature if f in configuration) or "none"


def parse_configuration(name: str) -> Configuration:
    return frozenset() if name == "none" else frozenset(AlignFeature(part) for part in name.split("+"))


def _row(summary: Mapping[str, Any]) -> dict[str, Any]:
    return {key: summary[key] for key in (*SUMMARY_KEYS, *(k for k in summary if k not in SUMMARY_KEYS))}


def attribution_report(
    features: Sequence[AlignFeature], results: Mapping[Configuration, Mapping[str, Any]]
) -> dict[str, Any]:
    """The `--attribute --json` report from one summary per configuration of `configuration_grid`
    (`mean_abs_diff`, `p99_abs_diff`, `max_abs_diff`, `tokens`, more keys kept, e.g. `worst_tokens`).

    Per feature: `mean_abs_diff_alone` (only it on) and `mean_abs_diff_without` (all on but it), p99 and
    max likewise, `gap_closed_alone` (the share of the baseline's mean it removes alone) and
    `cost_without` (how much the aligned mean grows when it is left out)."""
    grid = configuration_grid(features)
    missing = [configuration_name(c) for c in grid if c not in results]
    if missing:
        raise ValueError(f"no measurement for configuration(s) {', '.join(missing)}")
    every = frozenset(AlignFeature(f) for f in features)
    baseline, aligned = _row(results[frozenset()]), _row(results[every])
    rows = []
    for feature in dict.fromkeys(AlignFeature(f) for f in features):
        alone, without = results[frozenset({feature})], results[every - {feature}]
        row: dict[str, Any] = {"name": feature.value, "key": FEATURE_KEYS[feature]}
        for label, summary in (("alone", alone), ("without", without)):
            for key in ("mean_abs_diff", "p99_abs_diff", "max_abs_diff"):
                row[f"{key}_{label}"] = summary[key]
        row["gap_closed_alone"] = _share(baseline["mean_abs_diff"] - alone["mean_abs_diff"], baseline)
        row["cost_without"] = without["mean_abs_diff"] - aligned["mean_abs_diff"]
        row["worst_tokens_alone"] = list(alone.get("worst_tokens", []))
        row["worst_tokens_without"] = list(without.get("worst_tokens", []))
        rows.append(row)
    return {
        "baseline": baseline,
        "aligned": {**aligned, "features": [f.value for f in AlignFeature if f in every]},
        "features": rows,
        "reduction": {
            "mean": _ratio(baseline["mean_abs_diff"], aligned["mean_abs_diff"]),
            "p99": _ratio(baseline["p99_abs_diff"], aligned["p99_abs_diff"]),
        },
    }


def _share(removed: float, baseline: Mapping[str, Any]) -> float:
    total = float(baseline["mean_abs_diff"])
    return removed / total if total > 0 else 0.0


def _ratio(before: float, after: float) -> float | None:
    """before / after (None when after is 0: the features closed the gap entirely)."""
    return before / after if after > 0 else None
