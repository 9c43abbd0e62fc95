"""Recipe rules for quantized weights: SGLang's environment, checkpoints, verification, MIS and align keys."""

from __future__ import annotations

import copy

import pytest
from recipe_problems import validation_problems as problems

from dsv4rl.checks.validate import validate
from dsv4rl.config.choices import QuantMode, RolloutEngineKind
from dsv4rl.config.compose import ConfigError, compose
from dsv4rl.config.model_schema import ModelConfig
from dsv4rl.config.schema import Config, QuantConfig
from dsv4rl.model.model_dir import materialize_model


@pytest.fixture(scope="module")
def dapo_base() -> Config:
    return compose("dapo_math")


@pytest.fixture
def dapo(dapo_base: Config) -> Config:
    return copy.deepcopy(dapo_base)


@pytest.mark.parametrize("quant", ["none", "bf16", "fp8_rollout", "fp8_mxfp4"])
def test_every_quant_preset_composes_and_validates(quant: str) -> None:
    """Every preset validates, but fp8_mxfp4 with SGLang: no MoE runner of SGLang 0.5.23 updates MXFP4
    experts in place (dsv4rl.quant.sglang_moe), so dapo_math refuses it, naming what works."""
    for recipe in ("tiny_arith", "dapo_math"):
        cfg = compose(recipe, [f"quant={quant}"])
        assert cfg.quant.name == QuantMode(quant)
        if recipe == "dapo_math" and quant == "fp8_mxfp4":
            (problem,) = problems(cfg)
            assert "on mi355x" in problem and "SGLANG_DSV4_FP4_DEQUANT=1" in problem
            continue
        validate(cfg, check_paths=False)


def test_dapo_math_engine_env_is_what_sglang_needs(dapo: Config) -> None:
    assert problems(dapo) == []
    dapo.quant.engine_env.pop("SGLANG_OPT_FP8_WO_A_GEMM")
    (problem,) = problems(dapo)
    assert (
        "needs SGLANG_OPT_FP8_WO_A_GEMM=0" in problem
        and "+quant.engine_env.SGLANG_OPT_FP8_WO_A_GEMM=0" in problem
    )


def test_fp8_experts_need_a_conversion_or_a_converted_checkpoint(dapo: Config) -> None:
    dapo.quant.engine_env.pop("SGLANG_DSV4_FP4_DEQUANT")
    (problem,) = problems(dapo)
    assert "SGLANG_DSV4_FP4_DEQUANT=1" in problem and "SGLANG_DSV4_FP4_EXPERTS=0" in problem
    dapo.quant.engine_env["SGLANG_DSV4_FP4_EXPERTS"] = "0"  # an FP8-converted checkpoint
    assert problems(dapo) == []


def test_the_old_preset_mistake_is_refused(dapo: Config) -> None:
    """SGLANG_DSV4_FP4_EXPERTS=0 does not convert MXFP4 experts: with the release format it fails."""
    cfg = compose("dapo_math", ["quant=fp8_mxfp4", "+comm.env.SGLANG_DSV4_FP4_EXPERTS=0"])
    (problem,) = problems(cfg)
    assert "converts nothing" in problem and "remove it" in problem


def test_a_checkpoint_on_this_machine_is_checked_against_quant(dapo: Config, tmp_path) -> None:
    release = materialize_model(
        ModelConfig(), str(tmp_path / "release"), QuantConfig(name=QuantMode.fp8_mxfp4)
    )
    dapo.model.path = dapo.model.tokenizer = release
    assert [p for p in problems(dapo, check_paths=True) if "quant" in p or "SGLANG" in p] == []
    dapo.quant.engine_env = {"SGLANG_OPT_FP8_WO_A_GEMM": "0", "SGLANG_DSV4_FP4_EXPERTS": "0"}
    found = [p for p in problems(dapo, check_paths=True) if "SGLANG" in p]
    assert len(found) == 1 and "holds MXFP4 ones" in found[0] and "SGLANG_DSV4_FP4_DEQUANT=1" in found[0]
    bf16 = compose("dapo_math", ["quant=bf16", f"model.path={release}", f"model.tokenizer={release}"])
    found = [p for p in problems(bf16, check_paths=True) if "quant=" in p]
    assert len(found) == 1 and "holds an FP8 checkpoint" in found[0]


def test_the_reference_engine_needs_a_checkpoint_in_the_quant_format(tmp_path) -> None:
    path = materialize_model(ModelConfig(), str(tmp_path / "m"), QuantConfig(name=QuantMode.fp8_rollout))
    cfg = compose("tiny_arith", ["quant=fp8_mxfp4", f"model.path={path}", f"model.tokenizer={path}"])
    (problem,) = problems(cfg, check_paths=True)
    assert "holds fp8_rollout" in problem and "set quant=fp8_rollout" in problem
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    cfg = compose("tiny_arith", [f"model.path={empty}", f"model.tokenizer={path}"])
    assert any("no safetensors files" in p for p in problems(cfg, check_paths=True))


def test_verification_settings(dapo: Config) -> None:
    dapo.sync.verify.checksum = True
    (problem,) = problems(dapo)
    assert "sync.verify.checksum=true" in problem and "logprob_probe" in problem
    tiny = compose("tiny_arith", ["sync.verify.every_steps=0", "sync.verify.probe_length=1",
                                  "sync.verify.max_mean_abs_diff=-1"])  # fmt: skip
    found = problems(tiny)
    assert len(found) == 3 and any("every_steps" in p for p in found)
    assert tiny.parallel.rollout.engine == RolloutEngineKind.reference


def test_quant_block_and_scale_settings(dapo: Config) -> None:
    dapo.quant.block_size = [64, 64]
    (problem,) = problems(dapo)
    assert "128x128 blocks" in problem
    with pytest.raises(ConfigError, match="scale_fmt"):
        compose("tiny_arith", ["quant.scale_fmt=fp32"])
    with pytest.raises(ConfigError, match="expert_scale_dtype"):
        compose("tiny_arith", ["quant.expert_scale_dtype=bfloat16"])
    with pytest.raises(ConfigError, match="rollout_weights"):  # the old keys are gone, not ignored
        compose("tiny_arith", ["quant.rollout_weights=fp8"])


def test_mis_and_align_settings() -> None:
    found = problems(compose("tiny_arith", ["algo.mis.low=1.5", "align.prompts=0", "align.max_new_tokens=0"]))
    assert len(found) == 3
    assert any("0 < low <= 1 <= high" in p for p in found)
    assert any("align.prompts" in p for p in found) and any("align.max_new_tokens" in p for p in found)
