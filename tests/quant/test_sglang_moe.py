"""The MoE runner table: every key has a row, each row cites the released code, and each recipe gets the
backend, held formats and repeatability SGLang 0.5.23 gives it."""

from __future__ import annotations

import itertools
import re

import pytest

from dsv4rl.config.choices import DeviceKind, QuantMode
from dsv4rl.config.compose import compose
from dsv4rl.config.sglang_choices import DeviceFamily, ExpertLoad, MoeRunnerBackend
from dsv4rl.quant import sglang_env, sglang_moe
from dsv4rl.quant.sglang_moe import MOE_PATHS, expert_load, moe_path, recipe_moe_path, restart_reason

CITATION = re.compile(r"sglang/srt/[\w/]+\.py:\d+")


def dapo(*overrides: str):
    return compose("dapo_math", list(overrides))


def test_every_device_has_a_family_and_every_key_a_row() -> None:
    assert set(sglang_moe.DEVICE_FAMILY) == set(DeviceKind)
    for load, family, aiter in itertools.product(ExpertLoad, DeviceFamily, (False, True)):
        path = moe_path(load, family, aiter)
        assert path.updatable or path.fix, (load, family, aiter)  # a refusal names what works
        assert path.idempotent is not None or family == DeviceFamily.unknown


def test_every_row_cites_the_released_code() -> None:
    for load, family, _, path in MOE_PATHS:
        if family == DeviceFamily.unknown and load != ExpertLoad.mxfp4:
            continue  # the GPU decides; the known families' rows cite
        assert CITATION.search(path.source), (load, family, path.source)
        assert "../" not in path.source and "/work" not in path.source


def test_fp4_dequant_always_passes_auto() -> None:
    """SGLang asserts auto when SGLANG_DSV4_FP4_DEQUANT=1 (`fp8.py:425-429`)."""
    for family, aiter in itertools.product(DeviceFamily, (False, True)):
        path = moe_path(ExpertLoad.fp4_dequant, family, aiter)
        assert path.backend == MoeRunnerBackend.auto


def test_the_reference_run_is_updatable_but_needs_fresh_engines_after_a_failed_push() -> None:
    cfg = dapo()
    path = recipe_moe_path(cfg)
    assert expert_load(cfg.quant.name, sglang_env.engine_env(cfg)) == ExpertLoad.fp4_dequant
    assert (path.backend, path.resolves_to) == (MoeRunnerBackend.auto, MoeRunnerBackend.aiter)
    assert path.updatable and path.idempotent is False
    assert "fp8.py:2163-2174" in path.source.replace(",", ",fp8.py:")  # the re-shuffle at every close
    assert "re-shuffled" in restart_reason(cfg)
    assert sglang_moe.moe_problems(cfg) == []


def test_hopper_runs_the_dequantized_experts_under_triton_and_may_retry() -> None:
    cfg = dapo("cluster.device=h200")
    path = recipe_moe_path(cfg)
    assert (path.backend, path.resolves_to, path.idempotent) == ("auto", "triton", True)
    assert (path.experts, path.expert_scale_dtype) == (sglang_env.FP8, "float32")
    assert restart_reason(cfg) is None


@pytest.mark.parametrize("device", ["h100", "h200", "mi300x", "mi325x", "mi355x", "cpu"])
def test_mxfp4_experts_are_refused_everywhere_naming_what_works(device: str) -> None:
    cfg = dapo("quant=fp8_mxfp4", f"cluster.device={device}")
    (problem,) = sglang_moe.moe_problems(cfg)
    if device in ("mi300x", "mi325x"):  # no FP8 update works on gfx942
        assert "quant=bf16" in problem
        return
    assert "SGLANG_DSV4_FP4_DEQUANT=1" in problem and "quant=fp8_rollout" in problem
    if device == "cpu":
        assert "on every GPU family" in problem
    if device.startswith("h"):
        assert "flashinfer_mxfp4" in problem and "weight_loader" in problem


@pytest.mark.parametrize("device", ["mi300x", "mi325x"])
def test_fp8_on_gfx942_is_refused_bf16_works(device: str) -> None:
    (problem,) = sglang_moe.moe_problems(dapo(f"cluster.device={device}"))
    assert "e4m3fnuz" in problem and "quant=bf16" in problem
    assert sglang_moe.moe_problems(dapo(f"cluster.device={device}", "quant=bf16")) == []


def test_unknown_device_refuses_only_what_fails_everywhere() -> None:
    cfg = dapo("cluster.device=cpu", "cluster.gpus_per_node=0")
    assert sglang_moe.moe_problems(cfg) == []
    path = recipe_moe_path(cfg)
    assert path.resolves_to is None and path.idempotent is None
    assert "does not name the GPU" in restart_reason(cfg)
    info = sglang_moe.plan_info(cfg)
    assert info["device_family"] == "unknown" and info["restart_on_failed_push"] is True


def test_unquantized_checkpoints_run_triton_and_repeat_everywhere() -> None:
    for family, aiter in itertools.product(DeviceFamily, (False, True)):
        path = moe_path(ExpertLoad.unquantized, family, aiter)
        assert (path.backend, path.idempotent, path.expert_scale_dtype) == ("triton", True, None)


def test_aiter_only_counts_on_rocm() -> None:
    env = {"SGLANG_USE_AITER": "1"}
    assert sglang_moe.uses_aiter(DeviceFamily.cdna4, env)
    assert not sglang_moe.uses_aiter(DeviceFamily.hopper, env)  # `_use_aiter = ... and _is_hip`
    assert not sglang_moe.uses_aiter(DeviceFamily.cdna4, {})


def test_reference_engines_emulate_only_a_known_non_idempotent_path() -> None:
    assert sglang_moe.emulates_non_idempotent(dapo("parallel.rollout.engine=reference"))
    assert not sglang_moe.emulates_non_idempotent(
        dapo("parallel.rollout.engine=reference", "cluster.device=h200")
    )
    tiny = compose("tiny_arith", [])
    assert not sglang_moe.emulates_non_idempotent(tiny) and restart_reason(tiny) is None
    assert "emulates" in restart_reason(dapo("parallel.rollout.engine=reference"))


def test_the_emulation_asked_in_extra_args_makes_a_failed_push_end_the_run() -> None:
    """A CPU run rehearses non-idempotent engines (tests/e2e/test_failed_push_cpu.py): the reference
    engine's flag in engine.extra_args; SGLang engines refuse it (validation: tests/checks)."""
    tiny = compose("tiny_arith", ["engine.extra_args=[--emulate-non-idempotent-postprocess]"])
    assert sglang_moe.emulates_non_idempotent(tiny)
    assert "engine.extra_args has --emulate-non-idempotent-postprocess" in restart_reason(tiny)


def test_mxfp4_scale_dtype_follows_the_runner() -> None:
    """flashinfer_mxfp4 and aiter create E8M0 expert scales; FP8 block scales are float32 everywhere."""
    assert sglang_env.expert_scale_dtype({}, sglang_env.MXFP4, "flashinfer_mxfp4") == "float8_e8m0fnu"
    assert sglang_env.expert_scale_dtype({}, sglang_env.MXFP4, "triton") == "float32"
    assert sglang_env.expert_scale_dtype({}, sglang_env.FP8, "flashinfer_mxfp4") == "float32"
    assert moe_path(ExpertLoad.mxfp4, DeviceFamily.hopper).expert_scale_dtype == "float8_e8m0fnu"


def test_quant_modes_map_to_expert_loads() -> None:
    dequant = {"SGLANG_DSV4_FP4_DEQUANT": "1"}
    assert expert_load(QuantMode.bf16, dequant) == ExpertLoad.unquantized
    assert expert_load(QuantMode.fp8_rollout, dequant) == ExpertLoad.fp4_dequant
    assert expert_load(QuantMode.fp8_rollout, {"SGLANG_DSV4_FP4_EXPERTS": "0"}) == ExpertLoad.fp8
    assert expert_load(QuantMode.fp8_mxfp4, {}) == ExpertLoad.mxfp4
