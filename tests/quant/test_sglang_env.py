"""SGLang 0.5.23's DeepSeek-V4 environment variables: what an engine holds and what validation refuses."""

import pytest

from dsv4rl.quant.sglang_env import (
    FP8,
    MXFP4,
    UNQUANTIZED,
    checkpoint_problems,
    env_flag,
    env_problems,
    expert_format,
    expert_scale_dtype,
)

WO_A_OFF = {"SGLANG_OPT_FP8_WO_A_GEMM": "0"}


@pytest.mark.parametrize(
    ("env", "checkpoint", "method", "held"),
    [
        ({}, MXFP4, None, MXFP4),  # the released checkpoint: detected
        ({}, FP8, None, FP8),  # an FP8-converted checkpoint: detected
        ({}, None, None, MXFP4),  # header unreadable: SGLang's default
        ({"SGLANG_DSV4_FP4_EXPERTS": "0"}, FP8, None, FP8),
        ({"SGLANG_DSV4_FP4_EXPERTS": "0"}, MXFP4, None, FP8),  # detection off: FP8 params (start-up fails)
        ({"SGLANG_DSV4_FP4_EXPERTS": "0"}, MXFP4, "mxfp4", MXFP4),  # the checkpoint's config wins
        ({"SGLANG_DSV4_FP4_DEQUANT": "1"}, MXFP4, None, FP8),  # converted at load
        ({"SGLANG_DSV4_FP4_DEQUANT": "1", "SGLANG_DSV4_FP4_EXPERTS": "0"}, MXFP4, None, FP8),
        ({"SGLANG_DSV4_FP4_DEQUANT": "true"}, FP8, None, FP8),
        ({}, UNQUANTIZED, None, UNQUANTIZED),
    ],
)
def test_expert_format(env, checkpoint, method, held):
    assert expert_format(env, checkpoint, method) == held


def test_expert_scale_dtype_follows_aiter():
    assert expert_scale_dtype({"SGLANG_USE_AITER": "1"}, MXFP4) == "float8_e8m0fnu"
    assert expert_scale_dtype({}, MXFP4) == "float32"
    assert expert_scale_dtype({"SGLANG_USE_AITER": "1"}, FP8) == "float32"


def test_env_flag_parses_like_sglang():
    assert env_flag({"X": "Yes"}, "X", False) and not env_flag({"X": "n"}, "X", True)
    assert env_flag({}, "X", True)
    with pytest.raises(ValueError, match="X='maybe'"):
        env_flag({"X": "maybe"}, "X", False)


@pytest.mark.parametrize(
    ("quant", "env", "message"),
    [
        ("fp8_mxfp4", {}, "SGLANG_OPT_FP8_WO_A_GEMM=0"),
        ("fp8_rollout", {"SGLANG_DSV4_FP4_DEQUANT": "1"}, "SGLANG_OPT_FP8_WO_A_GEMM=0"),
        ("fp8_mxfp4", {**WO_A_OFF, "SGLANG_DSV4_FP4_EXPERTS": "0"}, "converts nothing"),
        ("fp8_mxfp4", {**WO_A_OFF, "SGLANG_DSV4_FP4_DEQUANT": "1"}, "convert its experts to FP8"),
        ("fp8_rollout", WO_A_OFF, "SGLANG_DSV4_FP4_DEQUANT=1 for the released"),
        (
            "fp8_rollout",
            {**WO_A_OFF, "SGLANG_DSV4_FP4_DEQUANT": "1", "SGLANG_AMD_USE_FLYDSL_MEGA_MOE": "1"},
            "aiter MegaMoE",
        ),
        ("fp8_mxfp4", {**WO_A_OFF, "SGLANG_USE_AITER": "perhaps"}, "SGLANG_USE_AITER='perhaps'"),
    ],
)
def test_env_problems(quant, env, message):
    problems = env_problems(quant, env)
    assert len(problems) == 1 and message in problems[0]


@pytest.mark.parametrize(
    ("quant", "env"),
    [
        ("fp8_mxfp4", WO_A_OFF),
        ("fp8_rollout", {**WO_A_OFF, "SGLANG_DSV4_FP4_DEQUANT": "1"}),
        ("fp8_rollout", {**WO_A_OFF, "SGLANG_DSV4_FP4_EXPERTS": "0"}),
        ("bf16", {}),
        ("none", {"SGLANG_DSV4_FP4_EXPERTS": "0"}),  # irrelevant to an unquantized checkpoint
    ],
)
def test_env_accepted(quant, env):
    assert env_problems(quant, env) == []


def test_checkpoint_problems():
    assert "unquantized checkpoint" in checkpoint_problems("fp8_mxfp4", WO_A_OFF, UNQUANTIZED)[0]
    assert "holds an FP8 checkpoint" in checkpoint_problems("bf16", {}, MXFP4)[0]
    assert "use quant=fp8_rollout" in checkpoint_problems("fp8_mxfp4", WO_A_OFF, FP8)[0]
    fp8_claimed = {**WO_A_OFF, "SGLANG_DSV4_FP4_EXPERTS": "0"}
    assert "fails at start-up" in checkpoint_problems("fp8_rollout", fp8_claimed, MXFP4)[0]
    assert checkpoint_problems("fp8_rollout", {**WO_A_OFF, "SGLANG_DSV4_FP4_DEQUANT": "1"}, MXFP4) == []
    assert checkpoint_problems("fp8_rollout", fp8_claimed, FP8) == []
    assert checkpoint_problems("fp8_mxfp4", WO_A_OFF, MXFP4) == []
    assert checkpoint_problems("bf16", {}, UNQUANTIZED) == []
