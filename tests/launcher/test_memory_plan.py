"""The memory plan: per-GPU arithmetic by hand, dapo_math fitting the MI355X, over-budget recipes refused."""

from __future__ import annotations

import copy
import json

import pytest
from typer.testing import CliRunner

from dsv4rl.checks.estimate import check_memory_budget
from dsv4rl.checks.validate import validate
from dsv4rl.cli import app
from dsv4rl.config.choices import DeviceKind, Dtype, QuantMode, RecomputeMode
from dsv4rl.config.compose import ConfigError, compose
from dsv4rl.config.schema import Config
from dsv4rl.estimate.devices import DEVICES
from dsv4rl.estimate.memory import (
    GpuRole,
    LayerActivations,
    activation_bytes,
    engine_weights_gb,
    memory_plan,
    micro_batches_in_flight,
    optimizer_bytes_per_param,
)
from dsv4rl.estimate.params import format_bytes, model_bytes, model_shape, stage_params
from dsv4rl.quant import sglang_moe

ADDRS = ["cluster.node_addrs=[gpu-a01,gpu-a02,gpu-a03,gpu-a04]", "cluster.master_addr=gpu-a01"]
# DeepSeek-V4-Flash from recipes/model/deepseek_v4_flash.yaml, by hand:
EXPERTS_PER_LAYER = 256 * 3 * 4096 * 2048  # 6,442,450,944
EMBEDDING = 129280 * 4096  # 529,530,880 (the head has as many)
DENSE_LAYERS = 284e9 - 43 * EXPERTS_PER_LAYER - 2 * EMBEDDING  # 5,915,547,648 over 43 layers


@pytest.fixture(scope="module")
def dapo_base() -> Config:
    return compose("dapo_math", ADDRS)


@pytest.fixture
def dapo(dapo_base: Config) -> Config:
    return copy.deepcopy(dapo_base)


def refusal(cfg: Config) -> list[str]:
    with pytest.raises(ConfigError) as info:
        validate(cfg, check_paths=False)
    return info.value.problems


def test_device_table_has_the_vendors_memory() -> None:
    assert {kind: spec.memory_gb for kind, spec in DEVICES.items()} == {
        DeviceKind.mi355x: 288.0,
        DeviceKind.mi300x: 192.0,
        DeviceKind.mi325x: 256.0,
        DeviceKind.h100: 80.0,
        DeviceKind.h200: 141.0,
    }
    assert DeviceKind.cpu not in DEVICES


def test_flash_parameters_by_stage(dapo: Config) -> None:
    shape = model_shape(dapo)
    assert shape is not None
    assert shape.layers * shape.expert_params_per_layer == 277_025_390_592  # the published 277.0 B
    assert shape.embedding_params == EMBEDDING
    assert shape.dense_params_per_layer == pytest.approx(DENSE_LAYERS / 43)
    first, _, _, last = stage_params(shape, [11, 11, 11, 10])
    assert first.dense == pytest.approx(11 * DENSE_LAYERS / 43 + EMBEDDING)  # the embedding on stage 0
    assert last.dense == pytest.approx(10 * DENSE_LAYERS / 43 + EMBEDDING)  # the head on the last
    assert (first.experts, last.experts) == (11 * EXPERTS_PER_LAYER, 10 * EXPERTS_PER_LAYER)


def test_optimizer_bytes_and_micro_batches_in_flight() -> None:
    assert optimizer_bytes_per_param(precision_aware=False, cpu_offload=False) == 12
    assert optimizer_bytes_per_param(precision_aware=True, cpu_offload=False) == 10  # 16-bit remainders
    assert optimizer_bytes_per_param(precision_aware=True, cpu_offload=True) == 12
    assert [micro_batches_in_flight(s, 4, 64) for s in range(4)] == [4, 3, 2, 1]
    assert micro_batches_in_flight(0, 4, 2) == 2


# DeepSeek-V4-Flash's attention per token (bf16): 4 x 64 x 512 + 3 x 4096 + 6 x 512 values on every layer,
# plus the compressor's 2 x (2 x 512) values and 512 selection slots of 9 bytes on its 21 CSA layers, 2 x 512
# values on its 20 HCA layers; averaged over the 43 layers (2 sliding)
_BASE = 2 * (4 * 64 * 512 + 3 * 4096 + 6 * 512)
ATTENTION_PER_TOKEN = (2 * _BASE + 21 * (_BASE + 2 * 2048 + 9 * 512) + 20 * (_BASE + 2 * 1024)) / 43
# the longest sequence dapo_math plans for: data.max_prompt_len + algo.sampling.max_new_tokens
TOKENS = 12288 + 4096
# one CSA chunk: 256 queries' gathered window + top-512 keys (and their gradient) in fp32,
# and 4 copies of their [64, 256, 128 + 512 + 1] fp32 scores
CSA_CHUNK = 2 * 256 * 640 * 512 * 4 + 4 * 64 * 256 * 641 * 4


def test_activations_by_recompute_mode() -> None:
    layer = LayerActivations(tensors=100, scores=50, streams=10)
    args = {"layers": 4, "tokens": 2, "in_flight": 3}
    assert activation_bytes(layer, **args, recompute=RecomputeMode.none) == 3 * 4 * 150 * 2
    assert activation_bytes(layer, **args, recompute=RecomputeMode.selective) == 3 * 4 * 100 * 2 + 50 * 2
    assert activation_bytes(layer, **args, recompute=RecomputeMode.full) == 3 * 4 * 10 * 2 + 150 * 2
    assert (
        activation_bytes(layer, **args, recompute=RecomputeMode.full, chunk_layers=2) == 3 * 2 * 10 * 2 + 600
    )
    with_logits = activation_bytes(layer, **args, recompute=RecomputeMode.full, logits_per_token=7)
    assert with_logits == 540 + 3 * 7 * 2
    sparse = LayerActivations(
        tensors=100, scores=0, streams=10, transient=1000
    )  # one layer's chunk at a time
    assert activation_bytes(sparse, **args, recompute=RecomputeMode.none) == 3 * 4 * 100 * 2 + 1000


def test_dapo_math_stage_0_by_hand(dapo: Config) -> None:
    """TP1/PP4/EP4/DP4, expert-DP 1: stage 0 holds 11 layers' dense part and the embedding, and a quarter
    of its 11 layers' experts."""
    stage0 = memory_plan(dapo).gpus[0]
    params = 11 * DENSE_LAYERS / 43 + EMBEDDING + 11 * EXPERTS_PER_LAYER / 4  # 19.76 B
    dense = 11 * DENSE_LAYERS / 43 + EMBEDDING
    # per token and layer: mHC streams and mixed inputs, norms; 7 experts; bf16
    tensors = 2 * (2 * 5 * 4096 + 2 * 4096 + 7 * (4096 + 3 * 2048))  # 241,664 bytes
    tensors += ATTENTION_PER_TOKEN  # the layer mix's attention tensors: 298,067 bytes
    streams = 2 * 4 * 4096
    # full recompute, 4 in flight; sparse attention: no scores kept, one CSA chunk's work while it runs
    activations = 4 * 11 * streams * TOKENS + tensors * TOKENS + CSA_CHUNK
    assert stage0.label == "trainer stage 0 (ranks 0..3)"
    assert stage0.components_gb == pytest.approx(
        {
            "weights": params * 2 / 1e9,  # 39.52
            "gradients": params * 4 / 1e9,  # 79.04
            "optimizer": 0.0,  # optimizer_offload_fraction 1.0: all of it on the host
            "activations": activations / 1e9,  # 33.30
            "overhead": 5.0,
        }
    )
    optimizer_on_host = 12 * (dense / 4 + 11 * EXPERTS_PER_LAYER / 4) / 1e9  # 218.73
    assert stage0.details["optimizer_on_cpu_gb"] == pytest.approx(optimizer_on_host, abs=0.01)
    assert stage0.total_gb == pytest.approx(156.87, abs=0.01) and stage0.fits


def test_a_kl_term_adds_the_reference_weights(dapo: Config) -> None:
    dapo.algo.kl_coef = 0.01
    stage0 = memory_plan(dapo).gpus[0]
    assert stage0.components_gb["reference_weights"] == stage0.components_gb["weights"]
    assert stage0.total_gb == pytest.approx(156.87 + 39.52, abs=0.01)


def test_last_stage_keeps_the_logits(dapo: Config) -> None:
    last = memory_plan(dapo).gpus[3]
    tensors = 2 * (2 * 5 * 4096 + 2 * 4096 + 7 * (4096 + 3 * 2048)) + ATTENTION_PER_TOKEN
    logits = 8 * 129280 * TOKENS  # fp32 logits and log-softmax of one micro batch
    expected = 10 * 2 * 4 * 4096 * TOKENS + tensors * TOKENS + CSA_CHUNK + logits
    assert last.components_gb["activations"] == pytest.approx(expected / 1e9)  # 32.00


def test_engine_weights_in_the_served_format(dapo: Config) -> None:
    shape = model_shape(dapo)
    assert shape is not None
    fp8 = model_bytes(shape, format_bytes(QuantMode.fp8_rollout, Dtype.bfloat16))
    assert fp8 == pytest.approx(277_093_023_744 + DENSE_LAYERS * (1 + 4 / 16384) + 2 * EMBEDDING * 2)
    mxfp4 = model_bytes(shape, format_bytes(QuantMode.fp8_mxfp4, Dtype.bfloat16))
    assert mxfp4 == pytest.approx(
        277_025_390_592 * (0.5 + 1 / 32) + DENSE_LAYERS * (1 + 4 / 16384) + 4 * EMBEDDING
    )
    assert engine_weights_gb(shape, dapo) == pytest.approx(fp8 / 8 / 1e9)  # TP8: 35.64 GB
    engine = memory_plan(dapo).gpus[-1]
    assert engine.role == GpuRole.rollout
    budget = 0.7 * 288  # SGLang's static budget: 165.96 GB of KV cache
    assert engine.components_gb == pytest.approx({"weights": fp8 / 8e9, "kv_cache": budget - fp8 / 8e9})
    assert engine.total_gb == pytest.approx(budget)


def test_dapo_math_fits_the_mi355x(dapo: Config) -> None:
    plan = memory_plan(dapo)
    assert (plan.device, plan.device_gb, plan.fits, plan.skipped) == ("mi355x", 288.0, True, None)
    assert [g.role for g in plan.gpus] == [GpuRole.trainer] * 4 + [GpuRole.rollout]
    assert max(g.total_gb for g in plan.gpus) == pytest.approx(0.7 * 288)  # the engines' static budget
    validate(dapo, check_paths=False)


def test_an_h100_cluster_is_refused_naming_the_override(dapo: Config) -> None:
    dapo.cluster.device = DeviceKind.h100
    dapo.parallel.rollout.tensor_parallel = dapo.parallel.rollout.gpus_per_engine = 4  # TP4: 71.3 GB
    dapo.parallel.rollout.num_engines = 4
    trainer, engine = refusal(dapo)
    assert "trainer stage 0 (ranks 0..3) needs 156.9 GB, a GPU has 80 GB" in trainer
    assert "gradients 79.0, weights 39.5, activations 33.3" in trainer
    assert "parallel.train.pipeline_parallel" in trainer and "run.force_memory_plan=true" in trainer
    assert "weights 71.3 GB leave no KV cache in the static budget 56.0 GB" in engine
    assert "quant=fp8_mxfp4" in engine and "run.force_memory_plan=true" in engine


def test_dapo_math_h200_fits_the_h200_with_headroom() -> None:
    """The NVIDIA recipe: dapo_math's algorithm, data and eval on 6 nodes x 8 H200, every GPU under 80 %
    of its 141 GB, NCCL, and SGLang's MoE path on Hopper (auto -> triton) idempotent."""
    nodes = [f"gpu-b0{i}" for i in range(1, 7)]
    h200 = compose(
        "dapo_math_h200", [f"cluster.node_addrs=[{','.join(nodes)}]", "cluster.master_addr=gpu-b01"]
    )
    dapo = compose("dapo_math", ADDRS)
    for group in ("algo", "data", "eval", "model", "quant", "reward", "optim", "train", "sync", "engine"):
        assert getattr(h200, group) == getattr(dapo, group), group
    assert (h200.comm.name, h200.comm.backend.value, h200.cluster.device) == (
        "nccl_h100",
        "nccl",
        DeviceKind.h200,
    )
    assert "SGLANG_USE_AITER" not in h200.comm.env
    validate(h200, check_paths=False)
    plan = memory_plan(h200)
    assert plan.fits and not plan.forced and plan.device_gb == 141.0
    assert [g.role for g in plan.gpus] == [GpuRole.trainer] * 4 + [GpuRole.rollout]
    assert max(g.total_gb for g in plan.gpus) <= 0.8 * 141.0
    moe = sglang_moe.plan_info(h200)
    assert (moe["device_family"], moe["resolves_to"], moe["idempotent"]) == ("hopper", "triton", True)
    dapo.cluster.device = DeviceKind.h200  # dapo_math itself on H200 nodes: refused by its memory plan
    (problem,) = refusal(dapo)
    assert "trainer stage 0 (ranks 0..3) needs 156.9 GB, a GPU has 141 GB" in problem


def test_no_pipeline_no_expert_split_no_offload_is_refused(dapo: Config) -> None:
    t = dapo.parallel.train
    t.pipeline_parallel, t.last_stage_layers, t.expert_parallel = 1, None, 1
    t.optimizer_cpu_offload, t.optimizer_offload_fraction = False, 0.0
    (problem,) = refusal(dapo)
    assert "trainer stage 0 (ranks 0..15) needs" in problem and "a GPU has 288 GB" in problem
    assert "optimizer_offload_fraction" in problem and "run.force_memory_plan=true" in problem


def test_the_forced_variant_passes_and_still_shows_it(dapo: Config) -> None:
    dapo.cluster.device = DeviceKind.h100
    dapo.run.force_memory_plan = True
    validate(dapo, check_paths=False)
    plan = memory_plan(dapo)
    assert plan.forced and not plan.fits


def test_a_broken_layout_is_named_without_a_memory_estimate(dapo: Config) -> None:
    dapo.parallel.train.tensor_parallel = 3
    dapo.cluster.device = DeviceKind.h100
    problems = refusal(dapo)
    assert problems and not any("memory plan" in p for p in problems)


def test_colocated_engine_budget_holds_the_trainers_resident_state(dapo: Config) -> None:
    """SGLang sizes its KV cache from free memory with the trainer's weights, gradients and optimizer in
    place: KV = static budget - trainer resident - engine weights."""
    dapo.parallel.colocate = True
    dapo.parallel.rollout.nnodes, dapo.cluster.nnodes = 0, 2
    dapo.cluster.node_addrs = dapo.cluster.node_addrs[:2]
    dapo.parallel.rollout.mem_fraction_static = 0.9
    gpu = memory_plan(dapo).gpus[0]
    assert gpu.role == GpuRole.colocated and gpu.fits and gpu.details["peak_phase"] == "rollout"
    resident = 39.519 + 79.038 + 0.0 + 5.0  # weights, gradients, no optimizer (on the host), overhead
    assert gpu.components_gb["engine_kv_cache"] == pytest.approx(0.9 * 288 - resident - 35.641, abs=0.01)
    dapo.parallel.rollout.mem_fraction_static = 0.55  # 158.4 GB < 123.6 + 35.6
    # (validation refuses colocating across nodes first; the budget rule on its own says why it cannot fit)
    found: list[str] = []
    check_memory_budget(dapo, found.append)
    (problem,) = found
    assert "159.2 GB of trainer state and engine weights" in problem and "158.4 GB" in problem


def test_cpu_recipes_are_not_checked() -> None:
    tiny = compose("tiny_arith")
    plan = memory_plan(tiny)
    assert plan.gpus == [] and plan.skipped == "not checked on CPU (cluster.device=cpu)"
    validate(tiny, check_paths=False)
    tiny.cluster.device = DeviceKind.h100  # a GPU, but the tiny model states no full-size facts
    assert "model.hidden_size" in (memory_plan(tiny).skipped or "")


def test_estimate_keys_are_checked(dapo: Config) -> None:
    dapo.estimate.mfu = 0.0
    dapo.estimate.response_len_fraction = 1.5
    problems = refusal(dapo)
    assert any("estimate.mfu must be in (0, 1]" in p for p in problems)
    assert any("estimate.response_len_fraction" in p for p in problems)


def test_plan_all_nodes_json_lists_roles_and_memory() -> None:
    """`dsv4rl plan recipe=dapo_math --all-nodes --json`: 4 nodes, their roles, each GPU's estimate."""
    result = CliRunner().invoke(
        app, ["plan", "recipe=dapo_math", "--all-nodes", "--json", "--skip-engine-check", *ADDRS]
    )
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["memory"]["device"] == "mi355x" and plan["memory"]["fits"] is True
    nodes = plan["nodes"]
    assert [n["roles"] for n in nodes] == [
        ["trainer (ranks 0..7)"],
        ["trainer (ranks 8..15)"],
        ["rollout"],
        ["rollout"],
    ]
    assert [[g["label"] for g in n["memory"]["per_gpu"]] for n in nodes[:2]] == [
        ["trainer stage 0 (ranks 0..3)", "trainer stage 1 (ranks 4..7)"],
        ["trainer stage 2 (ranks 8..11)", "trainer stage 3 (ranks 12..15)"],
    ]
    for node in nodes:
        memory = node["memory"]
        assert memory["device_gb"] == 288.0 and memory["fits"] and memory["peak_gb"] < 288.0
        for gpu in memory["per_gpu"]:
            assert gpu["total_gb"] == pytest.approx(sum(gpu["components_gb"].values()), abs=0.05)
    assert set(nodes[2]["memory"]["per_gpu"][0]["components_gb"]) == {"weights", "kv_cache"}
    assert plan["step_time"]["estimated"] is True


def test_plan_refuses_an_over_budget_recipe_and_shows_a_forced_one() -> None:
    runner = CliRunner()
    args = ["plan", "recipe=dapo_math", "--all-nodes", "--skip-engine-check", *ADDRS, "cluster.device=h100"]
    refused = runner.invoke(app, args)
    assert refused.exit_code == 2 and "run.force_memory_plan=true" in " ".join(refused.output.split())
    forced = runner.invoke(app, [*args, "run.force_memory_plan=true", "--json"])
    assert forced.exit_code == 0, forced.output
    memory = json.loads(forced.output)["memory"]
    assert (memory["forced"], memory["fits"], memory["device_gb"]) == (True, False, 80.0)


def test_plan_text_shows_the_memory_table_and_cpu_says_not_checked() -> None:
    runner = CliRunner()
    text = runner.invoke(app, ["plan", "recipe=dapo_math", "--all-nodes", "--skip-engine-check", *ADDRS])
    assert text.exit_code == 0, text.output
    assert "estimated against AMD Instinct MI355X (288 GB): fits" in text.output
    tiny = runner.invoke(app, ["plan", "recipe=tiny_arith"])
    assert "memory per GPU: not checked on CPU" in tiny.output
    assert (
        json.loads(runner.invoke(app, ["plan", "recipe=tiny_arith", "--json"]).output)["nodes"][0]["memory"]
        is None
    )
