"""DeepSeek-V4.1-Flash planned, not run: the model's facts equal what its shapes count, `dapo_math_v41`
(MI355X) and `dapo_math_v41_h200` validate and their memory plans fit with the Engram tables held frozen
(never on the wire), the engines are planned with V4.1's serving shortcut off, the plan shows the refusal
`dsv4rl train` stops on, and facts that contradict the architecture (indexer replay included) are
refused. SGLang's own parser reads the planned V4.1 commands in tests/launcher/test_plan_sglang.py."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dsv4rl.checks.validate import validate
from dsv4rl.cli import app
from dsv4rl.config.choices import ChatFormat, DeviceKind, ModelArchitecture
from dsv4rl.config.compose import ConfigError, compose
from dsv4rl.engine.sglang_contract import flag_problems, load_contract
from dsv4rl.estimate.attention import AttentionShape, LayerType, layer_types
from dsv4rl.estimate.memory import GpuRole, memory_plan
from dsv4rl.estimate.params import ENGRAM_BYTES, format_bytes, model_bytes, model_shape
from dsv4rl.launcher.plan import sglang_argv

RECIPES = {"dapo_math_v41": (DeviceKind.mi355x, 288.0, 4), "dapo_math_v41_h200": (DeviceKind.h200, 141.0, 8)}
REFUSAL = "model.architecture=deepseek_v41: dsv4rl's trainers do not build DeepSeek-V4.1 yet"
# DeepSeek-V4.1-Flash's config.json (docs/deepseek_v41.md has the public sources)
H, VOCAB, LAYERS, EXPERTS, INTER = 5120, 129280, 40, 384, 2304
HEADS, HEAD_DIM, Q_LORA, O_GROUPS, O_LORA, HC = 64, 512, 1280, 8, 1024, 4
RATIOS = [0, 0] + [2] * 18 + [1] * 20
KV_SOURCES, INDEX_SOURCES, INDEX_HEADS, INDEX_DIM = [2, 8, 14, 20], [2, 8, 14, 20, 24, 28, 32, 36], 32, 128
ENGRAM_ROWS, ENGRAM_DIM = [384_006_168, 384_016_682], 256


def counted_params() -> tuple[float, float]:
    """(total, active) from the shapes, tensor by tensor as SGLang's V4.1 model holds them."""
    expert = 3 * H * INTER
    q = H * Q_LORA + Q_LORA + Q_LORA * HEADS * HEAD_DIM  # wq_a, q_norm, wq_b
    kv = H * HEAD_DIM + HEAD_DIM  # wkv, kv_norm
    out = O_GROUPS * O_LORA * (HEADS * HEAD_DIM // O_GROUPS) + H * O_GROUPS * O_LORA  # wo_a, wo_b
    mhc = 2 * ((2 + HC) * HC * HC * H + (2 + HC) * HC + 3)  # hc_{attn,ffn}_{fn,base,scale}
    dense = q + kv + out + HEADS + expert + EXPERTS * H + EXPERTS + 2 * H + mhc  # sink, shared, router, norms
    compressors = sum(RATIOS[layer] * H * HEAD_DIM + HEAD_DIM for layer in KV_SOURCES)  # wkv (+ wgate), norm
    indexers = 0
    for layer in INDEX_SOURCES:  # wq_b, weights_proj; wk and k_norm where the layer owns its keys
        owns = HEAD_DIM * INDEX_DIM + INDEX_DIM if layer in KV_SOURCES else 0
        indexers += Q_LORA * INDEX_HEADS * INDEX_DIM + H * INDEX_HEADS + owns
    total = LAYERS * (EXPERTS * expert + dense) + compressors + indexers + 2 * VOCAB * H + H
    active = LAYERS * (6 * expert + dense) + compressors + indexers + VOCAB * H
    return total, active


def test_the_model_facts_are_what_its_shapes_count():
    cfg = compose("dapo_math_v41")
    m = cfg.model
    total, active = counted_params()
    assert m.architecture == ModelArchitecture.deepseek_v41
    assert m.total_params_b == pytest.approx(total / 1e9, abs=0.05)
    assert m.active_params_b == pytest.approx(active / 1e9, abs=0.05)
    assert m.engram_params_b == pytest.approx(sum(ENGRAM_ROWS) * ENGRAM_DIM / 1e9, abs=0.05)
    # SGLang's own V4.1-Flash test sizes the two FP8 tables (with their scales) at about 189 GiB
    assert m.engram_params_b * 1e9 * ENGRAM_BYTES / 2**30 == pytest.approx(189, abs=1)
    assert (m.compress_ratios, m.num_hidden_layers, m.hidden_size, m.vocab_size) == (RATIOS, LAYERS, H, VOCAB)
    types = layer_types(tuple(m.compress_ratios), m.num_hidden_layers)
    assert [types.count(t) for t in (LayerType.sliding, LayerType.c2, LayerType.c1)] == [2, 18, 20]


def test_v41_layers_select_the_indexers_top_k_of_their_entries():
    shape = AttentionShape(hidden=H, heads=HEADS, head_dim=HEAD_DIM)
    assert (shape.entries(LayerType.c1, 4096), shape.entries(LayerType.c2, 4096)) == (4096, 2048)
    assert shape.entries_seen(LayerType.c1, 4096) == shape.entries_seen(LayerType.c2, 4096) == 512
    assert shape.entries_seen(LayerType.c2, 600) == 300
    with pytest.raises(ValueError, match=r"one of \[0, 1, 2, 4, 128\]"):
        layer_types((0, 3), 2)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_the_v41_recipes_validate_and_fit_with_the_engram_frozen(recipe):
    device, device_gb, train_nodes = RECIPES[recipe]
    cfg = compose(recipe)
    validate(cfg, check_paths=False)
    dapo = compose("dapo_math")
    for group in ("algo", "reward", "optim", "train", "sync", "quant"):
        assert getattr(cfg, group) == getattr(dapo, group), group
    assert cfg.data.chat_format == cfg.eval.chat_format == ChatFormat.deepseek_v41
    plan = memory_plan(cfg)
    assert plan.fits and plan.device == device.value and plan.device_gb == device_gb
    assert [g.role for g in plan.gpus] == [GpuRole.trainer] * 4 + [GpuRole.rollout]
    world = train_nodes * 8
    shape = model_shape(cfg)
    for gpu in plan.gpus[:4]:
        assert gpu.components_gb["frozen_weights"] == pytest.approx(
            196.6e9 * ENGRAM_BYTES / world / 1e9, rel=1e-3
        )
        assert gpu.total_gb <= 0.8 * device_gb
    engine = plan.gpus[-1]
    tp = cfg.parallel.rollout.tensor_parallel
    engram_share = shape.frozen_params * ENGRAM_BYTES / tp / 1e9  # the engine serves the tables over TP
    assert engine.components_gb["weights"] > engram_share > 20 and engine.components_gb["kv_cache"] > 20


def test_the_weight_sync_carries_no_engram():
    cfg = compose("dapo_math_v41")
    shape = model_shape(cfg)
    fmt = format_bytes(cfg.quant.name, cfg.model.dtype)
    cfg.model.engram_params_b = None
    assert model_bytes(model_shape(cfg), fmt) == model_bytes(shape, fmt)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_plan_shows_the_plan_and_the_refusal_train_stops_on(recipe):
    result = CliRunner().invoke(
        app, ["plan", f"recipe={recipe}", "--all-nodes", "--skip-engine-check", "--json"]
    )
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["memory"]["fits"] and plan["step_time"]["step_s"] > 0
    assert any(REFUSAL in warning for warning in plan["warnings"]), plan["warnings"]
    with pytest.raises(ConfigError) as info:
        validate(compose(recipe), check_paths=True)
    assert any(problem.startswith(REFUSAL) for problem in info.value.problems)


def test_a_v41_model_is_refused_before_any_process_starts(tmp_path):
    result = CliRunner().invoke(
        app, ["train", "recipe=tiny_arith", "model=deepseek_v41_flash", f"run.dir={tmp_path}"]
    )
    assert result.exit_code == 2 and REFUSAL in result.output, result.output
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.architecture=deepseek_v4"], "model.compress_ratios has [1, 2], which model.architecture="),
        (["model.architecture=deepseek_v4"], "model.engram_params_b is DeepSeek-V4.1's"),
        (["model.compress_ratios=[0,2,1]"], "model.compress_ratios lists 3 layers but model.num_hidden"),
        ([f"model.compress_ratios=[0,4,128,{','.join(['1'] * 37)}]"], "model.compress_ratios has [4, 128]"),
    ],
)  # fmt: skip
def test_facts_that_contradict_the_architecture_are_refused(overrides, message):
    with pytest.raises(ConfigError) as info:
        validate(compose("dapo_math_v41", overrides), check_paths=False)
    assert any(message in problem for problem in info.value.problems), info.value.problems


def test_v41_engines_run_without_the_serving_shortcut(tmp_path):
    contract = load_contract()
    for recipe, flagged in (("dapo_math_v41", True), ("dapo_math", False)):
        argv = sglang_argv(compose(recipe), "/models/m", 30000, 0, 0, tmp_path)
        assert ("--no-enable-decoder-swa-bounded-replay" in argv) is flagged, recipe
        assert flag_problems(contract, argv[3:]) == [], recipe


def test_the_contract_takes_both_spellings_of_a_boolean_optional_flag():
    contract = load_contract()
    for flag in ("--enable-decoder-swa-bounded-replay", "--no-enable-decoder-swa-bounded-replay"):
        assert flag_problems(contract, [flag, "--tp-size", "8"]) == []
    assert flag_problems(contract, ["--no-tp-size"]) == ["--no-tp-size: not a flag of SGLang 0.5.23"]
    assert flag_problems(contract, ["--no-enable-decoder-swa-bounded-replay", "true"]) == [
        "true: not a flag of SGLang 0.5.23"
    ]


def test_indexer_replay_is_refused_for_v41_naming_why():
    with pytest.raises(ConfigError) as info:
        validate(compose("dapo_math_v41", ["algo.indexer_replay=true"]), check_paths=False)
    (problem,) = [p for p in info.value.problems if p.startswith("algo.indexer_replay=true with")]
    assert "V4.1 has none" in problem and "set algo.indexer_replay=false" in problem
