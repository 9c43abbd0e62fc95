"""`--numerics sglang`: the reference engine computes with SGLang 0.5.23's rounding points.

Which points apply follows from the checkpoint the engine serves, as in SGLang: FP8 activations only when
the checkpoint's linears are FP8 (and into the routed experts only when those are FP8 too), bf16 logits
unless `--enable-fp32-lm-head`. `--numerics-features` narrows the set, one named point at a time, so the
share of each in the train-vs-rollout gap can be measured (docs/numerics.md).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from dsv4rl.config.choices import NumericsFeature
from dsv4rl.engine.args import ServerArgs
from dsv4rl.engine.weight_store import DeepseekWeights
from dsv4rl.model.naming import CheckpointKind, checkpoint_kind
from dsv4rl.model.sglang_numerics import apply_sglang_numerics, served_weight, sglang_features

__all__ = ["fp8_storage", "install_numerics", "numerics_features"]

log = logging.getLogger("dsv4rl.engine")


def fp8_storage(stored: Mapping[str, torch.Tensor]) -> tuple[bool, bool]:
    """(the FP8 linears are stored in FP8, the routed experts are) in a checkpoint's tensors."""
    kinds = {checkpoint_kind(name) for name, t in stored.items() if t.dtype == torch.float8_e4m3fn}
    return CheckpointKind.fp8_linear in kinds, CheckpointKind.routed_expert in kinds


def numerics_features(args: ServerArgs, fp8_checkpoint: bool) -> frozenset[NumericsFeature]:
    """The rounding points the flags ask for; ValueError naming the flag and the fix for a bad set."""
    if args.numerics != "sglang":
        if args.numerics_features:
            raise ValueError("--numerics-features needs --numerics sglang")
        return frozenset()
    default = sglang_features(fp8_checkpoint, args.enable_fp32_lm_head)
    if not args.numerics_features:
        return default
    names = [name.strip() for name in args.numerics_features.split(",") if name.strip()]
    valid = [f.value for f in NumericsFeature]
    unknown = [name for name in names if name not in valid]
    if unknown:
        raise ValueError(f"--numerics-features: unknown {unknown}; choose from {', '.join(valid)}")
    chosen = frozenset(NumericsFeature(name) for name in names)
    if NumericsFeature.act_fp8 in chosen and not fp8_checkpoint:
        raise ValueError(
            "--numerics-features act_fp8: the checkpoint's linears are not FP8, and SGLang quantizes the "
            "activations only of FP8 linears; serve an FP8 checkpoint (quant=fp8_rollout or fp8_mxfp4)"
        )
    if NumericsFeature.bf16_logits in chosen and args.enable_fp32_lm_head:
        raise ValueError("--numerics-features bf16_logits contradicts --enable-fp32-lm-head; drop one")
    return chosen


def install_numerics(args: ServerArgs, weights: DeepseekWeights) -> frozenset[NumericsFeature]:
    """Install the rounding points the flags ask for on the engine's model; returns them (empty: exact)."""
    fp8_linears, fp8_experts = fp8_storage(weights.state())
    features = numerics_features(args, fp8_linears)
    if not features:
        return features
    if NumericsFeature.bf16_weights in features:
        weights.value_rule = served_weight
        weights.refresh()
    apply_sglang_numerics(weights.model, features - {NumericsFeature.bf16_weights}, fp8_experts=fp8_experts)
    log.info("numerics=sglang: %s", ", ".join(sorted(features)))
    return features
