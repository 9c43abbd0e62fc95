"""Rounding-mode rules: `engine.numerics`, `engine.numerics_features`, `engine.fp32_lm_head` and
`train.numerics.*` against the engines, the trainer backend and the quant mode (docs/numerics.md)."""

from __future__ import annotations

from dataclasses import fields

from dsv4rl.checks.problems import Add
from dsv4rl.config.choices import EngineNumerics, NumericsFeature, RolloutEngineKind, TrainBackend
from dsv4rl.config.schema import Config


def check_numerics(cfg: Config, add: Add) -> None:
    eng, train = cfg.engine, cfg.train.numerics
    quantized = cfg.quant.name.quantized
    if eng.numerics == EngineNumerics.sglang and cfg.parallel.rollout.engine == RolloutEngineKind.sglang:
        add(
            "engine.numerics=sglang makes the reference engine round as SGLang does; SGLang engines already "
            "do: set engine.numerics=exact, or parallel.rollout.engine=reference to measure the emulation"
        )
    features = eng.numerics_features
    if features is not None and eng.numerics != EngineNumerics.sglang:
        add("engine.numerics_features chooses SGLang's rounding points: it needs engine.numerics=sglang")
    if features is not None and not features:
        add("engine.numerics_features=[] rounds nothing: use engine.numerics=exact (null: every point)")
    if features is not None and NumericsFeature.act_fp8 in features and not quantized:
        add(
            f"engine.numerics_features has act_fp8, but quant={cfg.quant.name.value} serves no FP8 linears "
            "(SGLang quantizes the activations of FP8 linears only): use quant=fp8_mxfp4 or fp8_rollout"
        )
    if features is not None and NumericsFeature.bf16_logits in features and eng.fp32_lm_head:
        add("engine.numerics_features has bf16_logits and engine.fp32_lm_head=true: drop one of them")
    rounding = [f.name for f in fields(train) if getattr(train, f.name)]
    if rounding and cfg.parallel.train.backend == TrainBackend.megatron:
        add(
            f"train.numerics.{'/'.join(rounding)}: the rounding is installed in the transformers model, and "
            "the megatron backend has none yet; use parallel.train.backend=fsdp or set it false"
        )
    if train.act_fp8 and not quantized:
        add(
            f"train.numerics.act_fp8 rounds the inputs of FP8 linears, but quant={cfg.quant.name.value} has "
            "none: use quant=fp8_mxfp4 or fp8_rollout, or train.numerics.act_fp8=false"
        )
