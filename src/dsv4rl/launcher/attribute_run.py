"""`dsv4rl align --attribute`: the features that apply to a recipe, one align run per engine start, and
the merged report (`<run dir>/attribute.json`).

Which features apply is decided by validation itself: a feature is offered when the recipe with it on
validates (routing replay needs a score-routed layer, indexer replay a CSA layer and SGLang's attention TP
of 1, `train.numerics.*` the fsdp backend, `act_fp8` an FP8 checkpoint). The trainer-side rounding is
offered only against an engine that rounds (SGLang, or the reference engine with engine.numerics=sglang):
against an exact engine it can only add error.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dsv4rl.algo.attribution import (
    ENGINE_FEATURES,
    SEQUENCES_FILE,
    TRAINER_ROUNDING,
    attribution_report,
    configuration_grid,
    engine_groups,
    engine_report_file,
    parse_configuration,
)
from dsv4rl.checks.validate import validate
from dsv4rl.config.choices import AlignFeature, EngineNumerics, RolloutEngineKind
from dsv4rl.config.compose import ConfigError
from dsv4rl.config.schema import Config

REPORT_FILE = "attribute.json"
# features set per configuration inside a run rather than for the whole run
_PER_CONFIGURATION = ENGINE_FEATURES | TRAINER_ROUNDING


def with_features(cfg: Config, features: set[AlignFeature] | frozenset[AlignFeature]) -> Config:
    """A copy of `cfg` with exactly `features` on (the recipe keys of `FEATURE_KEYS`)."""
    out = copy.deepcopy(cfg)
    out.algo.routing_replay = AlignFeature.routing_replay in features
    out.algo.indexer_replay = AlignFeature.indexer_replay in features
    out.engine.fp32_lm_head = AlignFeature.fp32_lm_head in features
    for feature in TRAINER_ROUNDING:
        setattr(out.train.numerics, feature.value, feature in features)
    return out


def _engine_rounds(cfg: Config) -> bool:
    return (
        cfg.parallel.rollout.engine == RolloutEngineKind.sglang
        or cfg.engine.numerics == EngineNumerics.sglang
    )


def applicable_features(cfg: Config) -> tuple[list[AlignFeature], dict[str, str]]:
    """(the features that apply to `cfg`, {feature: why not} for the others)."""
    chosen, skipped = [], {}
    for feature in AlignFeature:
        if feature in TRAINER_ROUNDING and not _engine_rounds(cfg):
            skipped[feature.value] = "the engine computes exactly (engine.numerics=exact): nothing to imitate"
            continue
        try:
            validate(with_features(cfg, {feature}), check_paths=False)
        except ConfigError as exc:
            skipped[feature.value] = exc.problems[0]
            continue
        chosen.append(feature)
    return chosen, skipped


def resolve_features(cfg: Config) -> tuple[list[AlignFeature], dict[str, str]]:
    """align.attribute as given (each must validate), or every feature that applies (null)."""
    if cfg.align.attribute is None:
        features, skipped = applicable_features(cfg)
        if not features:
            raise ConfigError(
                "align --attribute: no alignment feature applies to this recipe ("
                + "; ".join(f"{k}: {v}" for k, v in skipped.items())
                + ")"
            )
        return features, skipped
    if not cfg.align.attribute:
        raise ConfigError(
            "align.attribute=[] toggles nothing: name features, or null for every one that applies"
        )
    for feature in cfg.align.attribute:
        try:
            validate(with_features(cfg, {feature}), check_paths=False)
        except ConfigError as exc:
            raise ConfigError(
                f"align.attribute has {feature.value}, which this recipe refuses: {exc}"
            ) from None
    return list(dict.fromkeys(cfg.align.attribute)), {}


def engine_runs(cfg: Config, features: list[AlignFeature]) -> list[tuple[frozenset[AlignFeature], Config]]:
    """One validated config per engine start of the grid: its engine flags on, the replays on whenever
    they are attributed (so the engines capture their choices; the trainer toggles them per
    configuration), the trainer's rounding off (installed per configuration)."""
    runs = []
    for flags in engine_groups(configuration_grid(features)):
        run = with_features(cfg, {f for f in features if f in flags or f not in _PER_CONFIGURATION})
        if AlignFeature.fp32_lm_head not in features:
            run.engine.fp32_lm_head = cfg.engine.fp32_lm_head
        run.align.attribute = list(features)
        validate(run, check_paths=True)
        runs.append((flags, run))
    return runs


def run_attribution(
    cfg: Config,
    features: list[AlignFeature],
    skipped: dict[str, str],
    run_task: Callable[[Config, Path], dict],
) -> dict[str, Any]:
    """Run the align task once per engine start (`run_task(config, report path)` runs one and returns its
    report), the first sampling the sequences every later one reuses; write and return the report."""
    run_dir = Path(cfg.run.dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in (REPORT_FILE, SEQUENCES_FILE, *(p.name for p in run_dir.glob("attribute-*.json"))):
        (run_dir / stale).unlink(missing_ok=True)  # never mix in an earlier run's sequences or numbers
    results = {}
    engine_reports = []
    for flags, run in engine_runs(cfg, features):
        report = run_task(run, run_dir / engine_report_file(flags))
        engine_reports.append(report)
        for name, summary in report["configurations"].items():
            results[parse_configuration(name)] = summary
    out = attribution_report(features, results)
    out.update(
        {
            "quant": cfg.quant.name.value,
            "engine": cfg.parallel.rollout.engine.value,
            "engine_numerics": cfg.engine.numerics.value,
            "model": cfg.model.name,
            "sequences": engine_reports[0]["sequences"],
            "engine_starts": len(engine_reports),
            "skipped_features": skipped,
            "temperature": 1.0,
        }
    )
    path = run_dir / REPORT_FILE
    path.write_text(json.dumps(out, indent=2) + "\n")
    return out
