"""Memory per GPU for a recipe, against `cluster.device`: what `dsv4rl plan` shows and validation checks.

Training GPU (the Megatron engine, one entry per pipeline stage; its worst GPU is what counts):
- weights: the stage's dense parameters over TP, its routed experts over EP x expert-TP, in model.dtype;
- gradients: the same parameters at 4 bytes (the engine builds megatron's DDP with grad_reduce_in_fp32);
- optimizer: fp32 main parameters and the two Adam moments, 12 bytes a parameter (megatron-core's default
  dtypes), sharded by the distributed optimizer over DP (dense) and expert-DP (experts); the
  precision-aware optimizer without CPU offload keeps only the 16 low bits of the main parameters
  (`store_param_remainders`, 10 bytes), with offload megatron's HybridDeviceOptimizer keeps them in fp32;
  `optimizer_offload_fraction` of it lives on the CPU;
- activations: a micro batch padded to the prompt and response caps; 1F1B keeps (PP - stage) micro
  batches in flight. Per token and layer autograd keeps the two mHC sites' streams and mixed inputs and
  the two norm outputs (all replicated over TP), the attention's q, normed q and output (3 x heads x
  head_dim), each of the top-k and shared experts' input, gate, up and product (hidden + 3 x
  moe_intermediate), and the eager attention's softmax over all keys (heads x 1.25 x sequence: the
  window mask spans every position, plus CSA's sequence/4 compressed entries). Full recompute keeps only
  each chunk's input streams (hc_mult x hidden) and rebuilds one chunk at a time; selective rebuilds one
  layer's scores at a time. The last stage adds fp32 logits and their log-softmax (8 bytes x vocab / TP);
- overhead: `TRAIN_OVERHEAD_GB` for the runtime context, communicator buffers and allocator slack (an
  allowance, not derived);
- reference weights: with `algo.kl_coef > 0` the trainer holds a frozen copy of its weights (the KL term);
- frozen weights: DeepSeek-V4.1's Engram tables, FP8 as released, split by rows over every trainer rank
  (no gradients, no optimizer state; an assumption: no trainer builds V4.1 yet).
The FSDP engine shards weights, gradients and Adam moments (model.dtype) over every rank and gathers two
layers at a time (the one running and the one prefetched).

Rollout GPU (SGLang): the engine holds the weights in `quant`'s format, split over its TP ranks (experts
by EP, or by TP inside an EP group: TP-wide either way; dense over TP / attention DP), and the Engram
tables in FP8 over its TP ranks (SGLang can also keep them in host memory: not counted). SGLang gives the
KV cache what is free after loading minus (1 - mem_fraction_static) x device memory, so the static
budget mem_fraction_static x device holds the weights and the KV cache; the rest is its headroom.

Colocated (training and engines on the same GPUs): the engine releases its weights and KV cache while the
trainer trains (SGLang's memory release), and the trainer keeps its weights, gradients and GPU share of
the optimizer while the engine generates. SGLang measures free memory with those in place, so the static
budget must hold them as well: KV cache = static budget - trainer's resident memory - engine weights. The
GPU's peak is the larger of the training phase and the static budget (no mem_fraction_static: the whole
device).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

from dsv4rl.config.choices import AttentionImpl, QuantMode, RecomputeMode, RolloutEngineKind, TrainBackend
from dsv4rl.config.schema import Config
from dsv4rl.estimate.attention import (
    AttentionShape,
    dense_score_bytes_per_token,
    layer_types,
    per_token_bytes,
    sparse_chunk_bytes,
)
from dsv4rl.estimate.devices import GB, device_spec
from dsv4rl.estimate.params import (
    DTYPE_BYTES,
    ENGRAM_BYTES,
    ModelShape,
    StageParams,
    format_bytes,
    missing_shape_keys,
    model_shape,
    stage_params,
)
from dsv4rl.topology import data_parallel_size, stage_layers

TRAIN_OVERHEAD_GB = 5.0
MAIN_GRAD_BYTES = 4
MAIN_PARAM_BYTES, MAIN_PARAM_REMAINDER_BYTES = 4, 2
ADAM_MOMENT_BYTES = 8  # exp_avg and exp_avg_sq in fp32
LOGITS_BYTES_PER_VOCAB = 8  # fp32 logits and their log-softmax


class GpuRole(StrEnum):
    trainer = "trainer"
    rollout = "rollout"
    colocated = "colocated"  # a trainer rank and an engine's share on one GPU


@dataclass(frozen=True)
class GpuMemory:
    """One kind of GPU of the run: what it holds at its peak, in GB."""

    role: GpuRole
    label: str
    components_gb: dict[str, float]  # what is resident at the peak (sums to total_gb)
    total_gb: float
    device_gb: float
    fits: bool
    stage: int | None = None
    ranks: tuple[int, int] | None = None  # first and last trainer rank
    details: dict[str, float | str] = field(default_factory=dict)  # not summed: what explains the numbers
    fixes: tuple[str, ...] = ()  # what to change when it does not fit


@dataclass(frozen=True)
class MemoryPlan:
    device: str
    device_gb: float | None
    gpus: list[GpuMemory]
    forced: bool
    skipped: str | None = None  # why nothing was estimated

    @property
    def fits(self) -> bool:
        return all(g.fits for g in self.gpus)


# ------------------------------------------------------------------------------------------- the maths
def optimizer_bytes_per_param(precision_aware: bool, cpu_offload: bool) -> int:
    main = MAIN_PARAM_REMAINDER_BYTES if precision_aware and not cpu_offload else MAIN_PARAM_BYTES
    return main + ADAM_MOMENT_BYTES


def micro_batches_in_flight(stage: int, pipeline: int, micro_batches: int) -> int:
    """1F1B: stage s holds the forwards of (pipeline - s) micro batches before its first backward."""
    return max(1, min(pipeline - stage, micro_batches))


@dataclass(frozen=True)
class LayerActivations:
    """Bytes one decoder layer keeps for backward, per token, without recompute; and what one layer's
    sparse attention needs while it runs (one query chunk's work, bytes, not per token)."""

    tensors: float
    scores: float  # the dense attention's scores and biases (0 with the sparse form: chunks are rebuilt)
    streams: float  # the layer's input (what full recompute keeps)
    transient: float = 0.0  # one layer's sparse-attention chunk, forward or backward


def attention_shape(shape: ModelShape) -> AttentionShape:
    """The model's attention geometry: its heads and sizes, DeepSeek-V4's window, ratios and indexer."""
    return AttentionShape(hidden=shape.hidden, heads=shape.heads, head_dim=shape.head_dim)


def layer_activations(
    shape: ModelShape,
    seq_len: int,
    tp: int,
    value_bytes: int,
    attention: AttentionImpl = AttentionImpl.sparse,
    query_chunk: int = 256,
) -> LayerActivations:
    """The layer mix's average (the model's compress ratios: DeepSeek-V4's sliding, CSA and HCA layers,
    V4.1's ratio 1 and 2) of what a layer keeps; the attention's part from `estimate/attention.py`
    (measured per layer type by bench/attention_memory.py)."""
    h = shape.hidden
    replicated = 2 * (shape.hc_mult + 1) * h + 2 * h
    experts = (shape.experts_per_token + shape.shared_experts) * (h + 3 * shape.moe_intermediate)
    geometry = attention_shape(shape)
    types = layer_types(shape.compress_ratios, shape.layers)
    attention_tensors = sum(per_token_bytes(geometry, t, value_bytes, tp) for t in types) / len(types)
    if attention == AttentionImpl.dense:
        scores = sum(dense_score_bytes_per_token(geometry, t, seq_len, tp) for t in types) / len(types)
        transient = 0.0
    else:
        scores = 0.0
        transient = max(sparse_chunk_bytes(geometry, t, seq_len, query_chunk, tp) for t in set(types))
    return LayerActivations(
        tensors=value_bytes * (replicated + experts / tp) + attention_tensors,
        scores=scores,
        streams=value_bytes * shape.hc_mult * h,
        transient=transient,
    )


def activation_bytes(
    layer: LayerActivations,
    layers: int,
    tokens: int,
    in_flight: int,
    recompute: RecomputeMode,
    chunk_layers: int = 1,
    logits_per_token: float = 0.0,
) -> float:
    """Activations of a stage of `layers` layers with `in_flight` micro batches of `tokens` tokens."""
    full_layer = (layer.tensors + layer.scores) * tokens
    if recompute == RecomputeMode.full:
        chunk = min(max(1, chunk_layers), layers)
        kept = in_flight * math.ceil(layers / chunk) * layer.streams * tokens + chunk * full_layer
    elif recompute == RecomputeMode.selective:
        kept = in_flight * layers * layer.tensors * tokens + layer.scores * tokens
    else:
        kept = in_flight * layers * full_layer
    return kept + layer.transient + in_flight * logits_per_token * tokens


def engine_weights_gb(shape: ModelShape, cfg: Config) -> float:
    """One engine GPU's share of the served weights (experts and dense layers TP-wide; attention DP
    replicates the dense part over its groups)."""
    ro = cfg.parallel.rollout
    fmt = format_bytes(cfg.quant.name, cfg.model.dtype)
    dense_ranks = max(1, ro.tensor_parallel // max(1, ro.data_parallel))
    experts = shape.layers * shape.expert_params_per_layer * fmt.experts / max(1, ro.tensor_parallel)
    dense = (
        shape.layers * shape.dense_params_per_layer * fmt.dense + 2 * shape.embedding_params * fmt.embedding
    )
    frozen = shape.frozen_params * ENGRAM_BYTES / max(1, ro.tensor_parallel)
    return (experts + dense / dense_ranks + frozen) / GB


# ------------------------------------------------------------------------------------------- the GPUs
def _train_fixes(cfg: Config) -> tuple[str, ...]:
    t = cfg.parallel.train
    fixes = ["more pipeline stages or expert parallelism (parallel.train.pipeline_parallel, expert_parallel)"]
    if not t.optimizer_cpu_offload or t.optimizer_offload_fraction < 1:
        fixes.append(
            "more of the optimizer on the CPU (parallel.train.optimizer_cpu_offload=true, a larger "
            "optimizer_offload_fraction)"
        )
    if t.recompute != RecomputeMode.full:
        fixes.append("full activation recompute (parallel.train.recompute=full)")
    if t.backend == TrainBackend.megatron and t.attention == AttentionImpl.dense:
        fixes.append("the sparse attention, linear in the sequence length (parallel.train.attention=sparse)")
    fixes.append("shorter micro batches (train.micro_batch_size, data.max_prompt_len, max_new_tokens)")
    return tuple(fixes)


SMALLER_FORMATS = {
    QuantMode.none: "quant=fp8_rollout or fp8_mxfp4",
    QuantMode.bf16: "quant=fp8_rollout or fp8_mxfp4",
    QuantMode.fp8_rollout: "quant=fp8_mxfp4, MXFP4 experts",
}


def _rollout_fixes(cfg: Config) -> tuple[str, ...]:
    fixes = ["more GPUs per engine (parallel.rollout.tensor_parallel, expert_parallel, gpus_per_engine)"]
    if cfg.quant.name in SMALLER_FORMATS:
        fixes.append(f"a smaller weight format ({SMALLER_FORMATS[cfg.quant.name]})")
    fixes.append("a larger parallel.rollout.mem_fraction_static")
    return tuple(fixes)


def _tokens_per_micro_batch(cfg: Config) -> int:
    return cfg.train.micro_batch_size * (cfg.data.max_prompt_len + cfg.algo.sampling.max_new_tokens)


def _micro_batches(cfg: Config, data_parallel: int) -> int:
    a = cfg.algo
    samples = a.prompts_per_step * a.group_size / max(1, a.updates_per_step)
    return max(1, math.ceil(samples / max(1, data_parallel) / max(1, cfg.train.micro_batch_size)))


def _trainer_parts(cfg: Config, shape: ModelShape) -> list[tuple[StageParams | None, dict, dict]]:
    """(stage, components in GB, details) of each kind of training GPU."""
    t = cfg.parallel.train
    value_bytes = DTYPE_BYTES[cfg.model.dtype]
    tokens = _tokens_per_micro_batch(cfg)
    seq_len = cfg.data.max_prompt_len + cfg.algo.sampling.max_new_tokens
    logits = LOGITS_BYTES_PER_VOCAB * shape.vocab
    world = t.nnodes * t.nproc_per_node
    frozen = (
        {"frozen_weights": shape.frozen_params * ENGRAM_BYTES / world / GB} if shape.frozen_params else {}
    )
    if t.backend == TrainBackend.fsdp:  # transformers' attention: dense
        layer = layer_activations(shape, seq_len, 1, value_bytes, AttentionImpl.dense)
        gathered = 2 * (shape.dense_params_per_layer + shape.expert_params_per_layer) * value_bytes
        acts = activation_bytes(
            layer, shape.layers, tokens, 1, t.recompute, t.recompute_granularity_layers, logits
        )
        components = {
            "weights": (shape.total_params * value_bytes / world + gathered) / GB,
            "gradients": shape.total_params * value_bytes / world / GB,
            "optimizer": shape.total_params * 2 * value_bytes / world / GB,
            "activations": acts / GB,
            "overhead": TRAIN_OVERHEAD_GB,
        }
        if cfg.algo.kl_coef > 0:
            components["reference_weights"] = shape.total_params * value_bytes / world / GB
        return [(None, components | frozen, {"params_b": shape.total_params / world / 1e9})]
    dp = data_parallel_size(cfg)
    expert_dp = max(1, world // (t.pipeline_parallel * t.expert_parallel * t.expert_tensor_parallel))
    attention = AttentionImpl.dense if t.attention == AttentionImpl.dense else AttentionImpl.sparse
    layer = layer_activations(
        shape, seq_len, t.tensor_parallel, value_bytes, attention, t.attention_query_chunk
    )
    micro = _micro_batches(cfg, dp)
    offloaded = t.optimizer_offload_fraction if t.optimizer_cpu_offload else 0.0
    opt_bytes = optimizer_bytes_per_param(t.precision_aware_optimizer, t.optimizer_cpu_offload)
    parts = []
    stages = stage_params(shape, stage_layers(cfg))
    for sp in stages:
        dense = sp.dense / t.tensor_parallel
        experts = sp.experts / (t.expert_parallel * t.expert_tensor_parallel)
        params = dense + experts
        optimizer = opt_bytes * (dense / dp + experts / expert_dp)
        in_flight = micro_batches_in_flight(sp.stage, t.pipeline_parallel, micro)
        last_logits = logits / t.tensor_parallel if sp.stage == len(stages) - 1 else 0.0
        acts = activation_bytes(
            layer, sp.layers, tokens, in_flight, t.recompute, t.recompute_granularity_layers, last_logits
        )
        components = {
            "weights": params * value_bytes / GB,
            "gradients": params * MAIN_GRAD_BYTES / GB,
            "optimizer": optimizer * (1 - offloaded) / GB,
            "activations": acts / GB,
            "overhead": TRAIN_OVERHEAD_GB,
        }
        if cfg.algo.kl_coef > 0:
            components["reference_weights"] = params * value_bytes / GB
        components |= frozen
        details = {
            "params_b": params / 1e9,
            "layers": sp.layers,
            "micro_batches_in_flight": in_flight,
            "tokens_per_micro_batch": tokens,
            "optimizer_on_cpu_gb": optimizer * offloaded / GB,
            "recompute": t.recompute.value,
            "attention": attention.value,
        }
        parts.append((sp, components, details))
    return parts


def _ranks(cfg: Config, stage: StageParams | None) -> tuple[int, int]:
    t = cfg.parallel.train
    world = t.nnodes * t.nproc_per_node
    if stage is None:
        return 0, world - 1
    per_stage = world // t.pipeline_parallel
    return stage.stage * per_stage, (stage.stage + 1) * per_stage - 1


def _label(stage: StageParams | None, ranks: tuple[int, int]) -> str:
    where = f"ranks {ranks[0]}..{ranks[1]}" if ranks[0] != ranks[1] else f"rank {ranks[0]}"
    return f"all trainer {where}" if stage is None else f"trainer stage {stage.stage} ({where})"


def _trainer_gpu(cfg: Config, stage: StageParams | None, components: dict, details: dict, device_gb: float):
    ranks = _ranks(cfg, stage)
    total = sum(components.values())
    fits = total <= device_gb
    return GpuMemory(
        GpuRole.trainer, _label(stage, ranks), components, total, device_gb, fits,
        stage.stage if stage else None, ranks, details, () if fits else _train_fixes(cfg),
    )  # fmt: skip


def _engine_gpu(cfg: Config, shape: ModelShape, device_gb: float) -> GpuMemory:
    ro = cfg.parallel.rollout
    weights = engine_weights_gb(shape, cfg)
    label = (
        f"rollout engine GPU (TP{ro.tensor_parallel}/EP{ro.expert_parallel}, quant={cfg.quant.name.value})"
    )
    details: dict[str, float | str] = {"quant": cfg.quant.name.value}
    if ro.mem_fraction_static is None:  # SGLang picks the fraction itself: only the weights are checked
        fits = weights <= device_gb
        components = {"weights": weights}
    else:
        budget = ro.mem_fraction_static * device_gb
        fits = weights < budget
        components = {"weights": weights, "kv_cache": max(0.0, budget - weights)}
        details.update(
            static_fraction=ro.mem_fraction_static, static_gb=budget, headroom_gb=device_gb - budget
        )
    total = sum(components.values())
    fixes = () if fits else _rollout_fixes(cfg)
    return GpuMemory(GpuRole.rollout, label, components, total, device_gb, fits, details=details, fixes=fixes)


def _colocated_gpu(
    cfg: Config, shape: ModelShape, stage: StageParams | None, train: dict, details: dict, device_gb: float
) -> GpuMemory:
    ro = cfg.parallel.rollout
    ranks = _ranks(cfg, stage)
    training = sum(train.values())
    resident = training - train["activations"]
    engine = engine_weights_gb(shape, cfg)
    budget = (ro.mem_fraction_static or 1.0) * device_gb
    kv = budget - resident - engine
    rollout = {k: v for k, v in train.items() if k != "activations"}
    rollout.update(engine_weights=engine, engine_kv_cache=max(0.0, kv))
    peak = train if training >= budget else rollout
    fits = training <= device_gb and kv > 0
    details = {
        **details,
        "training_phase_gb": training,
        "static_gb": budget,
        "resident_and_engine_weights_gb": resident + engine,
        "peak_phase": "training",
    }
    if peak is rollout:
        details["peak_phase"] = "rollout"
    fixes = () if fits else _train_fixes(cfg) + _rollout_fixes(cfg)
    return GpuMemory(
        GpuRole.colocated, _label(stage, ranks) + " + engine share", peak, sum(peak.values()), device_gb,
        fits, stage.stage if stage else None, ranks, details, fixes,
    )  # fmt: skip


def memory_plan(cfg: Config) -> MemoryPlan:
    """Every kind of GPU of the run with its estimate; `skipped` says why there is none (CPU, missing
    model facts)."""
    device = cfg.cluster.device.value
    forced = cfg.run.force_memory_plan
    spec = device_spec(cfg)
    if spec is None:
        return MemoryPlan(device, None, [], forced, "not checked on CPU (cluster.device=cpu)")
    shape = model_shape(cfg)
    if shape is None:
        missing = ", ".join(missing_shape_keys(cfg))
        return MemoryPlan(
            device, spec.memory_gb, [], forced, f"not estimated: the recipe does not state {missing}"
        )
    device_gb = spec.memory_gb
    parts = _trainer_parts(cfg, shape)
    sglang = cfg.parallel.rollout.engine == RolloutEngineKind.sglang
    if cfg.parallel.colocate and sglang:
        gpus = [_colocated_gpu(cfg, shape, sp, c, d, device_gb) for sp, c, d in parts]
    else:
        gpus = [_trainer_gpu(cfg, sp, c, d, device_gb) for sp, c, d in parts]
        if sglang:
            gpus.append(_engine_gpu(cfg, shape, device_gb))
    return MemoryPlan(device, device_gb, gpus, forced)
