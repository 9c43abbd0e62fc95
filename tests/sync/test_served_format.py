"""What an engine serves, decided from its checkpoint and environment, against the recipe's quant."""

from __future__ import annotations

import pytest
import torch

from dsv4rl.config.choices import ExpertScaleDtype, QuantMode, RolloutEngineKind
from dsv4rl.config.schema import QuantConfig
from dsv4rl.model.native_checkpoint import CheckpointFormat
from dsv4rl.quant.fp8 import E4M3
from dsv4rl.quant.scales import E8M0
from dsv4rl.sync.errors import WeightSyncError
from dsv4rl.sync.served_format import ServedFormat, served_format, wire_format_for

RELEASE = CheckpointFormat(QuantMode.fp8_mxfp4, E4M3, "mxfp4", E8M0, (128, 128))
CONVERTED = CheckpointFormat(QuantMode.fp8_rollout, E4M3, "fp8", E8M0, (128, 128))
WO_A = {"SGLANG_OPT_FP8_WO_A_GEMM": "0"}


def test_reference_engine_holds_the_checkpoint_as_stored():
    assert served_format(RolloutEngineKind.reference, RELEASE, {"SGLANG_DSV4_FP4_DEQUANT": "1"}, "x") == (
        ServedFormat(QuantMode.fp8_mxfp4, E8M0, (128, 128), "x")
    )


@pytest.mark.parametrize(
    ("checkpoint", "env", "mode", "scale"),
    [
        (RELEASE, WO_A, QuantMode.fp8_mxfp4, torch.float32),  # CUDA: float32 MXFP4 scales
        (RELEASE, {**WO_A, "SGLANG_USE_AITER": "1"}, QuantMode.fp8_mxfp4, E8M0),  # ROCm aiter: E8M0
        (RELEASE, {**WO_A, "SGLANG_DSV4_FP4_DEQUANT": "1"}, QuantMode.fp8_rollout, torch.float32),
        (CONVERTED, {**WO_A, "SGLANG_DSV4_FP4_EXPERTS": "0"}, QuantMode.fp8_rollout, torch.float32),
    ],
)
def test_sglang_holds_what_its_environment_makes_of_the_checkpoint(checkpoint, env, mode, scale):
    served = served_format(RolloutEngineKind.sglang, checkpoint, env, "ckpt")
    assert (served.mode, served.expert_scale_dtype) == (mode, scale)


def test_the_moe_runner_decides_the_mxfp4_scale_dtype():
    """The planner's MoE row: flashinfer_mxfp4 (what auto becomes on Hopper) creates E8M0 expert scales;
    FP8 experts keep float32 scales under any runner."""
    from dsv4rl.config.sglang_choices import DeviceFamily, ExpertLoad
    from dsv4rl.quant.sglang_moe import moe_path

    hopper = moe_path(ExpertLoad.mxfp4, DeviceFamily.hopper)
    served = served_format(RolloutEngineKind.sglang, RELEASE, WO_A, "ckpt", hopper)
    assert (served.mode, served.expert_scale_dtype) == (QuantMode.fp8_mxfp4, E8M0)
    dequant = {**WO_A, "SGLANG_DSV4_FP4_DEQUANT": "1"}
    aiter = moe_path(ExpertLoad.fp4_dequant, DeviceFamily.cdna4, aiter=True)
    served = served_format(RolloutEngineKind.sglang, RELEASE, dequant, "ckpt", aiter)
    assert (served.mode, served.expert_scale_dtype) == (QuantMode.fp8_rollout, torch.float32)


def test_the_wire_follows_the_engine():
    served = [("http://a", ServedFormat(QuantMode.fp8_mxfp4, torch.float32, (128, 128), "ckpt"))]
    wire = wire_format_for(QuantConfig(name=QuantMode.fp8_mxfp4), served)
    assert (wire.mode, wire.expert_scale_dtype, wire.block) == (
        QuantMode.fp8_mxfp4,
        torch.float32,
        (128, 128),
    )


@pytest.mark.parametrize(
    ("quant", "served", "message"),
    [
        (QuantConfig(), ServedFormat(QuantMode.fp8_mxfp4, E8M0, (128, 128), "checkpoint /m"),
         r"engine http://a serves fp8_mxfp4 \(from checkpoint /m\), but the recipe sends quant=none: "
         r"run with quant=fp8_mxfp4"),
        (QuantConfig(name=QuantMode.fp8_rollout), ServedFormat(None, None, (128, 128), "/m"),
         "a layout no quant mode produces"),
        (QuantConfig(name=QuantMode.fp8_mxfp4, block_size=[64, 64]),
         ServedFormat(QuantMode.fp8_mxfp4, E8M0, (128, 128), "/m"), r"quant.block_size=\[128, 128\]"),
        (QuantConfig(name=QuantMode.fp8_mxfp4, expert_scale_dtype=ExpertScaleDtype.float8_e8m0fnu),
         ServedFormat(QuantMode.fp8_mxfp4, torch.float32, (128, 128), "/m"),
         "holds routed-expert scales as float32"),
    ],
)  # fmt: skip
def test_mismatches_stop_before_the_first_push(quant, served, message):
    with pytest.raises(WeightSyncError, match=message):
        wire_format_for(quant, [("http://a", served)])


def test_engines_of_two_platforms_cannot_share_a_broadcast():
    served = [
        ("http://a", ServedFormat(QuantMode.fp8_mxfp4, torch.float32, (128, 128), "/m")),
        ("http://b", ServedFormat(QuantMode.fp8_mxfp4, E8M0, (128, 128), "/m")),
    ]
    with pytest.raises(WeightSyncError, match="different dtypes"):
        wire_format_for(QuantConfig(name=QuantMode.fp8_mxfp4), served)
