"""`engine.numerics*`, `engine.fp32_lm_head`, `train.numerics.*` against engines, backend and quant mode."""

from __future__ import annotations

import pytest
from recipe_problems import recipe_problems

from dsv4rl.config.compose import compose
from dsv4rl.config.schema import Config


def problems(*overrides: str, recipe: str = "tiny_arith") -> list[str]:
    return recipe_problems(recipe, *overrides)


def assert_problem(overrides: list[str], *fragments: str, recipe: str = "tiny_arith") -> None:
    found = problems(*overrides, recipe=recipe)
    assert any(all(f in p for f in fragments) for p in found), found


def test_valid_settings_pass() -> None:
    assert problems("engine.numerics=sglang") == []
    assert problems("engine.numerics=sglang", "engine.numerics_features=[kv_fp8,bf16_logits]") == []
    assert problems("engine.numerics=sglang", "engine.fp32_lm_head=true", "train.numerics.kv_fp8=true") == []
    assert (
        problems(
            "quant=fp8_mxfp4",
            "engine.numerics=sglang",
            "train.numerics.act_fp8=true",
            "engine.numerics_features=[act_fp8]",
        )
        == []
    )
    assert problems("model=tiny_dsv4_align", "engine.numerics=sglang") == []


def test_sglang_numerics_are_refused_with_sglang_engines() -> None:
    assert_problem(
        ["engine.numerics=sglang"], "SGLang engines already", "engine.numerics=exact", recipe="dapo_math"
    )
    assert problems("engine.fp32_lm_head=true", recipe="dapo_math") == []


def test_features_need_sglang_numerics_and_a_consistent_set() -> None:
    assert_problem(["engine.numerics_features=[kv_fp8]"], "needs engine.numerics=sglang")
    assert_problem(["engine.numerics=sglang", "engine.numerics_features=[]"], "rounds nothing")
    assert_problem(
        ["engine.numerics=sglang", "engine.numerics_features=[act_fp8]"], "quant=none", "fp8_mxfp4"
    )
    assert_problem(
        ["engine.numerics=sglang", "engine.numerics_features=[bf16_logits]", "engine.fp32_lm_head=true"],
        "drop one",
    )


def test_trainer_rounding_needs_fsdp_and_fp8_linears() -> None:
    assert_problem(["train.numerics.act_fp8=true"], "train.numerics.act_fp8", "quant=none")
    assert_problem(
        ["train.numerics.kv_fp8=true", "parallel.train.backend=megatron"],
        "megatron backend",
        "parallel.train.backend=fsdp",
    )


@pytest.mark.parametrize("heads", [2, 8])
def test_a_selecting_indexer_needs_enough_heads(heads: int) -> None:
    overrides = [
        "model.tiny.index_topk=2",
        f"model.tiny.index_n_heads={heads}",
        "algo.sampling.max_new_tokens=16",
    ]
    found = [p for p in problems(*overrides) if "index_topk" in p]
    assert bool(found) == (heads < 8), found


def test_the_planner_passes_the_flags(tmp_path) -> None:
    from dsv4rl.launcher.plan import build_local_plan

    cfg: Config = compose(
        "tiny_arith",
        ["engine.numerics=sglang", "engine.numerics_features=[kv_fp8,mhc_tf32]", "engine.fp32_lm_head=true"],
    )
    argv = build_local_plan(cfg, tmp_path, base_env={})[0].argv
    assert argv[argv.index("--numerics") + 1] == "sglang"
    assert argv[argv.index("--numerics-features") + 1] == "kv_fp8,mhc_tf32"
    assert "--enable-fp32-lm-head" in argv
    assert "--numerics" not in build_local_plan(compose("tiny_arith", []), tmp_path, base_env={})[0].argv
