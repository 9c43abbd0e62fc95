"""Cross-field rules for a composed recipe, checked before any process starts.

The schema (`dsv4rl.config.schema`) already fixes key names and types; these rules catch settings that
are individually well-typed but impossible together (a parallel layout that does not divide the world,
a batch that does not split across data-parallel ranks, a backend without GPUs). Every problem is
reported at once, each naming the key, the value and the fix.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from dsv4rl.config.compose import ConfigError
from dsv4rl.config.schema import (
    CommBackend,
    Config,
    RolloutEngineKind,
    SamplingConfig,
    TrainBackend,
)

__all__ = ["ConfigError", "validate", "data_parallel_size", "GRADERS", "PAUSE_MODES"]

GRADERS = ("arith", "dapo", "boxed", "math_verify")
PAUSE_MODES = ("abort", "retract", "in_place")
SYNC_NAMINGS = ("native", "hf")
OPTIMIZERS = ("adam", "adamw")
SCALE_FORMATS = ("ue8m0", "fp32")
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
LOOPBACK = ("127.0.0.1", "localhost", "::1")
NODE_ADDRS_FIX = (
    "pass cluster.node_addrs=[host0,host1,...] (every node's hostname or IP, in node-rank order; "
    "launch/slurm/dapo_math_4node.sbatch passes it from `scontrol show hostnames`)"
)
# Same as dsv4rl.model.tiny.LAYER_TYPES / MLP_TYPES (not imported: that pulls in torch and transformers).
LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
MLP_TYPES = ("hash_moe", "moe")

Add = Callable[[str], None]


def validate(cfg: Config, check_paths: bool = True) -> None:
    """Raise ConfigError listing every impossible setting of `cfg`.

    `check_paths=False` skips the checks that read this machine or its environment (model, tokenizer
    and data paths; a real master address for multi-node runs), so a cluster recipe can be composed
    and inspected anywhere (`dsv4rl train --cfg`).
    """
    problems: list[str] = []
    for check in _CHECKS:
        check(cfg, problems.append)
    if check_paths:
        _check_paths(cfg, problems.append)
        _check_built(cfg, problems.append)
    if len(problems) == 1:
        raise ConfigError(f"recipe {cfg.recipe!r}: {problems[0]}", problems)
    if problems:
        listing = "\n".join(f"  - {p}" for p in problems)
        raise ConfigError(f"recipe {cfg.recipe!r} has {len(problems)} problems:\n{listing}", problems)


def data_parallel_size(cfg: Config) -> int:
    """Training data-parallel size: world / (tensor x pipeline x context parallel)."""
    t = cfg.parallel.train
    return (t.nnodes * t.nproc_per_node) // max(
        1, t.tensor_parallel * t.pipeline_parallel * t.context_parallel
    )


def num_layers(cfg: Config) -> int:
    """Decoder layers: the full model's fact when the recipe states it, else the tiny model's."""
    m = cfg.model
    return m.num_hidden_layers if m.num_hidden_layers is not None else m.tiny.num_hidden_layers


def num_routed_experts(cfg: Config) -> int:
    m = cfg.model
    return m.n_routed_experts if m.n_routed_experts is not None else m.tiny.n_routed_experts


# --------------------------------------------------------------------------------------------------


def _positive(add: Add, **values: float) -> bool:
    ok = True
    for key, value in values.items():
        if value < 1:
            add(f"{key.replace('__', '.')} must be >= 1 (got {value})")
            ok = False
    return ok


def _check_train_layout(cfg: Config, add: Add) -> None:
    t = cfg.parallel.train
    if not _positive(
        add,
        parallel__train__nnodes=t.nnodes,
        parallel__train__nproc_per_node=t.nproc_per_node,
        parallel__train__tensor_parallel=t.tensor_parallel,
        parallel__train__pipeline_parallel=t.pipeline_parallel,
        parallel__train__expert_parallel=t.expert_parallel,
        parallel__train__expert_tensor_parallel=t.expert_tensor_parallel,
        parallel__train__context_parallel=t.context_parallel,
        parallel__train__recompute_granularity_layers=t.recompute_granularity_layers,
    ):
        return
    world = t.nnodes * t.nproc_per_node
    model_parallel = t.tensor_parallel * t.pipeline_parallel * t.context_parallel
    if world % model_parallel:
        add(
            f"training world size {world} (parallel.train.nnodes {t.nnodes} x nproc_per_node "
            f"{t.nproc_per_node}) is not divisible by tensor x pipeline x context parallel "
            f"({t.tensor_parallel} x {t.pipeline_parallel} x {t.context_parallel} = {model_parallel}); "
            "data parallel = world / (tp x pp x cp) must be a whole number"
        )
    experts = num_routed_experts(cfg)
    if experts % t.expert_parallel:
        source = "n_routed_experts" if cfg.model.n_routed_experts is not None else "tiny.n_routed_experts"
        add(
            f"parallel.train.expert_parallel={t.expert_parallel} must divide the {experts} routed experts "
            f"(model.{source})"
        )
    per_stage = world // t.pipeline_parallel if world % t.pipeline_parallel == 0 else None
    expert_group = t.expert_parallel * t.expert_tensor_parallel
    if per_stage is None or per_stage % expert_group:
        add(
            f"expert_parallel x expert_tensor_parallel ({t.expert_parallel} x {t.expert_tensor_parallel}) "
            f"must divide the ranks of one pipeline stage (world {world} / pipeline_parallel "
            f"{t.pipeline_parallel})"
        )
    _check_pipeline(cfg, add)
    if t.backend == TrainBackend.fsdp:
        others = {
            "tensor_parallel": t.tensor_parallel,
            "pipeline_parallel": t.pipeline_parallel,
            "expert_parallel": t.expert_parallel,
            "expert_tensor_parallel": t.expert_tensor_parallel,
            "context_parallel": t.context_parallel,
        }
        bad = [f"{k}={v}" for k, v in others.items() if v != 1]
        if bad:
            add(
                f"the fsdp backend shards data only, but parallel.train has {', '.join(bad)}: set them to 1 "
                "or use parallel.train.backend=megatron"
            )
    if t.backend == TrainBackend.megatron and cfg.cluster.gpus_per_node == 0:
        add(
            "parallel.train.backend=megatron needs GPUs but cluster.gpus_per_node=0 (CPU): use the fsdp "
            "backend on CPU (parallel=cpu_single or parallel=cpu_fsdp2)"
        )
    if cfg.cluster.gpus_per_node > 0 and t.nproc_per_node > cfg.cluster.gpus_per_node:
        add(
            f"parallel.train.nproc_per_node={t.nproc_per_node} exceeds cluster.gpus_per_node="
            f"{cfg.cluster.gpus_per_node} (one training process per GPU)"
        )
    if not 0.0 <= t.optimizer_offload_fraction <= 1.0:
        add(
            "parallel.train.optimizer_offload_fraction must be in [0, 1] "
            f"(got {t.optimizer_offload_fraction})"
        )
    elif t.optimizer_offload_fraction > 0 and not t.optimizer_cpu_offload:
        add(
            f"parallel.train.optimizer_offload_fraction={t.optimizer_offload_fraction} has no effect "
            "without parallel.train.optimizer_cpu_offload=true"
        )


def _check_pipeline(cfg: Config, add: Add) -> None:
    t = cfg.parallel.train
    layers, pp, last = num_layers(cfg), t.pipeline_parallel, t.last_stage_layers
    if pp > layers:
        add(f"parallel.train.pipeline_parallel={pp} exceeds the model's {layers} layers")
        return
    if last is None:
        if layers % pp:
            add(
                f"{layers} layers do not split evenly over pipeline_parallel={pp}: set "
                f"parallel.train.last_stage_layers so the other {pp - 1} stages share the rest evenly"
            )
        return
    if pp == 1:
        if last != layers:
            add(f"parallel.train.last_stage_layers={last} needs pipeline_parallel > 1 (or null)")
        return
    rest = layers - last
    if not 1 <= last <= layers - (pp - 1) or rest % (pp - 1):
        add(
            f"parallel.train.last_stage_layers={last} is invalid for {layers} layers and pipeline_parallel="
            f"{pp}: it must be in 1..{layers - (pp - 1)} and leave a multiple of {pp - 1} layers "
            "for the other stages"
        )


def _check_nodes_and_rollout(cfg: Config, add: Add) -> None:
    t, r, c = cfg.parallel.train, cfg.parallel.rollout, cfg.cluster
    if c.nnodes < 1:
        add(f"cluster.nnodes must be >= 1 (got {c.nnodes})")
        return
    if not 0 <= c.node_rank < c.nnodes:
        add(f"cluster.node_rank={c.node_rank} must be in 0..{c.nnodes - 1} (cluster.nnodes={c.nnodes})")
    if c.gpus_per_node < 0:
        add(f"cluster.gpus_per_node must be >= 0 (got {c.gpus_per_node})")
    if r.nnodes < 0:
        add(f"parallel.rollout.nnodes must be >= 0 (got {r.nnodes})")
    elif r.nnodes > 0:
        if cfg.parallel.colocate:
            add("parallel.colocate=true shares the training GPUs: set parallel.rollout.nnodes=0")
        if r.nnodes + t.nnodes != c.nnodes:
            add(
                f"disaggregated layout: parallel.rollout.nnodes ({r.nnodes}) + parallel.train.nnodes "
                f"({t.nnodes}) must equal cluster.nnodes ({c.nnodes})"
            )
    elif t.nnodes != c.nnodes:
        add(
            f"parallel.train.nnodes ({t.nnodes}) must equal cluster.nnodes ({c.nnodes}) when rollout shares "
            "the training nodes (parallel.rollout.nnodes=0)"
        )
    if not _positive(
        add,
        parallel__rollout__num_engines=r.num_engines,
        parallel__rollout__tensor_parallel=r.tensor_parallel,
        parallel__rollout__expert_parallel=r.expert_parallel,
        parallel__rollout__data_parallel=r.data_parallel,
    ):
        return
    if r.gpus_per_engine < 0:
        add(f"parallel.rollout.gpus_per_engine must be >= 0 (got {r.gpus_per_engine})")
    if c.gpus_per_node == 0:
        if r.engine == RolloutEngineKind.sglang:
            add(
                "parallel.rollout.engine=sglang needs GPUs but cluster.gpus_per_node=0 (CPU): use "
                "parallel.rollout.engine=reference"
            )
        if r.gpus_per_engine > 0:
            add(
                f"parallel.rollout.gpus_per_engine={r.gpus_per_engine} but the cluster has no GPUs: "
                "set it to 0"
            )
    elif r.engine == RolloutEngineKind.sglang and r.gpus_per_engine < 1:
        add("parallel.rollout.gpus_per_engine must be >= 1 for sglang engines on GPUs")
    if r.gpus_per_engine > 0 and c.gpus_per_node > 0:
        if r.gpus_per_engine != r.tensor_parallel:
            add(
                f"parallel.rollout.gpus_per_engine={r.gpus_per_engine} must equal parallel.rollout."
                f"tensor_parallel={r.tensor_parallel} (SGLang's --tp-size spans all GPUs of an engine)"
            )
        for key, value in (("expert_parallel", r.expert_parallel), ("data_parallel", r.data_parallel)):
            if r.tensor_parallel % value:
                add(
                    f"parallel.rollout.{key}={value} must divide parallel.rollout.tensor_parallel="
                    f"{r.tensor_parallel}"
                )
        needed = r.num_engines * r.gpus_per_engine
        if r.nnodes > 0:
            available, where = r.nnodes * c.gpus_per_node, f"{r.nnodes} rollout nodes"
        elif cfg.parallel.colocate:
            available, where = c.nnodes * c.gpus_per_node, f"{c.nnodes} colocated nodes"
        else:
            spare = max(0, c.gpus_per_node - t.nproc_per_node)
            available, where = c.nnodes * spare, f"the GPUs training leaves free on {c.nnodes} nodes"
        if needed > available:
            add(
                f"{r.num_engines} engines x {r.gpus_per_engine} GPUs = {needed} GPUs, but {where} "
                f"have {available}"
            )
    if r.mem_fraction_static is not None and not 0.0 < r.mem_fraction_static <= 1.0:
        add(f"parallel.rollout.mem_fraction_static must be in (0, 1] (got {r.mem_fraction_static})")
    if r.max_running_requests is not None and r.max_running_requests < 1:
        add(f"parallel.rollout.max_running_requests must be >= 1 (got {r.max_running_requests})")
    if r.watchdog_timeout_s <= 0:
        add(f"parallel.rollout.watchdog_timeout_s must be > 0 (got {r.watchdog_timeout_s})")


def _engine_nodes_text(cfg: Config) -> str:
    r, t, c = cfg.parallel.rollout, cfg.parallel.train, cfg.cluster
    if r.nnodes > 0 and not cfg.parallel.colocate:
        return f"nodes {t.nnodes}..{t.nnodes + r.nnodes - 1}"
    return f"nodes 0..{c.nnodes - 1}"


def _check_cluster_addresses(cfg: Config, add: Add) -> None:
    """Multi-node: engine URLs are `http://<cluster.node_addrs[node]>:<port>`, so engines must bind a
    non-loopback address and node_addrs (when given; required by the path checks) must name every node."""
    c = cfg.cluster
    if c.node_addrs and len(c.node_addrs) != c.nnodes:
        add(
            f"cluster.node_addrs lists {len(c.node_addrs)} address(es) but cluster.nnodes={c.nnodes}: "
            f"{NODE_ADDRS_FIX}"
        )
    if any(not a.strip() for a in c.node_addrs):
        add(f"cluster.node_addrs has an empty entry ({list(c.node_addrs)}); {NODE_ADDRS_FIX}")
    if c.nnodes > 1 and cfg.engine.host in LOOPBACK:
        add(
            f"engine.host={cfg.engine.host} binds loopback only, but with cluster.nnodes={c.nnodes} trainer "
            f"rank 0 on node 0 reaches the engines on {_engine_nodes_text(cfg)} through "
            "cluster.node_addrs: set engine.host=0.0.0.0"
        )


def _check_comm(cfg: Config, add: Add) -> None:
    if cfg.comm.backend == CommBackend.nccl and cfg.cluster.gpus_per_node == 0:
        add("comm.backend=nccl needs GPUs but cluster.gpus_per_node=0 (CPU): use comm=cpu_gloo")
    for key in cfg.comm.env:
        if not key or "=" in key or " " in key:
            add(f"comm.env has an invalid environment variable name {key!r}")


def _check_sampling(prefix: str, s: SamplingConfig, add: Add) -> None:
    if s.temperature < 0:
        add(f"{prefix}.temperature must be >= 0 (got {s.temperature}; 0 means greedy)")
    if not 0.0 < s.top_p <= 1.0:
        add(f"{prefix}.top_p must be in (0, 1] (got {s.top_p})")
    if s.top_k != -1 and s.top_k < 1:
        add(f"{prefix}.top_k must be -1 (off) or >= 1 (got {s.top_k})")
    if s.max_new_tokens < 1:
        add(f"{prefix}.max_new_tokens must be >= 1 (got {s.max_new_tokens})")


def _check_algo(cfg: Config, add: Add) -> None:
    a = cfg.algo
    if a.group_size < 2:
        add(
            f"algo.group_size={a.group_size}: GRPO compares responses to the same prompt, so a group "
            "needs >= 2 responses"
        )
    if a.prompts_per_step < 1:
        add(f"algo.prompts_per_step must be >= 1 (got {a.prompts_per_step})")
    if a.updates_per_step < 1:
        add(f"algo.updates_per_step must be >= 1 (got {a.updates_per_step})")
    if not 0.0 < a.eps_clip_low < 1.0:
        add(f"algo.eps_clip_low must be in (0, 1) (got {a.eps_clip_low}); the ratio is clipped at 1 - eps")
    if a.eps_clip_high <= 0.0:
        add(f"algo.eps_clip_high must be > 0 (got {a.eps_clip_high})")
    if a.kl_coef < 0:
        add(f"algo.kl_coef must be >= 0 (got {a.kl_coef})")
    if a.tis.clip <= 0:
        add(f"algo.tis.clip must be > 0 (got {a.tis.clip})")
    if a.dynamic_sampling.max_oversample_factor < 1:
        add(
            "algo.dynamic_sampling.max_oversample_factor must be >= 1 "
            f"(got {a.dynamic_sampling.max_oversample_factor})"
        )
    _check_sampling("algo.sampling", a.sampling, add)
    o = a.overlong
    if o.enabled:
        if o.expected_len < 1 or o.buffer_len < 1:
            add(
                "algo.overlong.expected_len and buffer_len must be >= 1 "
                f"(got {o.expected_len}, {o.buffer_len})"
            )
        elif o.expected_len >= a.sampling.max_new_tokens:
            add(
                f"algo.overlong.expected_len={o.expected_len} is not below algo.sampling.max_new_tokens="
                f"{a.sampling.max_new_tokens}, so the overlong penalty can never apply: lower expected_len "
                "or disable algo.overlong"
            )
        if o.penalty < 0:
            add(f"algo.overlong.penalty must be >= 0 (got {o.penalty}; it is subtracted)")
    if a.group_size >= 1 and a.prompts_per_step >= 1 and a.updates_per_step >= 1:
        samples = a.prompts_per_step * a.group_size
        dp = data_parallel_size(cfg)
        if dp >= 1 and samples % (dp * a.updates_per_step):
            add(
                f"algo.prompts_per_step x group_size = {samples} responses must split evenly into "
                f"algo.updates_per_step={a.updates_per_step} mini-batches over {dp} data-parallel ranks "
                f"(a multiple of {dp * a.updates_per_step})"
            )


def _check_optim(cfg: Config, add: Add) -> None:
    o = cfg.optim
    if o.name not in OPTIMIZERS:
        add(f"optim.name={o.name!r} is not supported; choose one of {', '.join(OPTIMIZERS)}")
    if o.lr <= 0:
        add(f"optim.lr must be > 0 (got {o.lr})")
    if o.weight_decay < 0:
        add(f"optim.weight_decay must be >= 0 (got {o.weight_decay})")
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        add(f"optim.betas must be two values in [0, 1) (got {list(o.betas)})")
    if o.eps <= 0:
        add(f"optim.eps must be > 0 (got {o.eps})")
    if o.grad_clip < 0:
        add(f"optim.grad_clip must be >= 0 (got {o.grad_clip}; 0 disables clipping)")
    if o.warmup_steps < 0:
        add(f"optim.warmup_steps must be >= 0 (got {o.warmup_steps})")


def _longest_sequence(cfg: Config) -> int:
    new_tokens = cfg.algo.sampling.max_new_tokens
    if cfg.eval.name != "none":
        new_tokens = max(new_tokens, cfg.eval.sampling.max_new_tokens)
    return cfg.data.max_prompt_len + new_tokens


def _check_model(cfg: Config, add: Add) -> None:
    m, tiny = cfg.model, cfg.model.tiny
    if m.path is None:
        n = tiny.num_hidden_layers
        if n < 1:
            add(f"model.tiny.num_hidden_layers must be >= 1 (got {n})")
        for key, values, allowed in (
            ("layer_types", tiny.layer_types, LAYER_TYPES),
            ("mlp_layer_types", tiny.mlp_layer_types, MLP_TYPES),
        ):
            if len(values) != n:
                add(
                    f"model.tiny.{key} lists {len(values)} entries but num_hidden_layers={n}: "
                    "give one per layer"
                )
            unknown = sorted(set(values) - set(allowed))
            if unknown:
                add(f"model.tiny.{key} has unknown values {unknown}; choose from {', '.join(allowed)}")
        if not 1 <= tiny.num_experts_per_tok <= tiny.n_routed_experts:
            add(
                f"model.tiny.num_experts_per_tok={tiny.num_experts_per_tok} must be in 1..n_routed_experts="
                f"{tiny.n_routed_experts}"
            )
        longest = _longest_sequence(cfg)
        if tiny.max_position_embeddings < longest:
            add(
                f"model.tiny.max_position_embeddings={tiny.max_position_embeddings} is below the longest "
                f"sequence ({longest} = data.max_prompt_len + max_new_tokens)"
            )
        uses_csa = "compressed_sparse_attention" in tiny.layer_types
        if (
            uses_csa
            and cfg.parallel.rollout.engine == RolloutEngineKind.reference
            and tiny.csa_compress_rate >= 1
        ):
            needed = math.ceil(longest / tiny.csa_compress_rate)
            if tiny.index_topk < needed:
                add(
                    f"model.tiny.index_topk={tiny.index_topk} is below "
                    f"ceil(({cfg.data.max_prompt_len} prompt + "
                    f"{longest - cfg.data.max_prompt_len} new tokens) / csa_compress_rate "
                    f"{tiny.csa_compress_rate}) = {needed}: the reference engine's cached decoding would no "
                    f"longer equal a full forward; set model.tiny.index_topk={needed} or shorten "
                    "data.max_prompt_len / max_new_tokens"
                )
    else:
        if m.num_hidden_layers is not None and m.num_hidden_layers < 1:
            add(f"model.num_hidden_layers must be >= 1 (got {m.num_hidden_layers})")
        if m.n_routed_experts is not None and m.n_routed_experts < 1:
            add(f"model.n_routed_experts must be >= 1 (got {m.n_routed_experts})")


def _check_data_reward_eval(cfg: Config, add: Add) -> None:
    d, r, e = cfg.data, cfg.reward, cfg.eval
    if d.name != "tiny_arith" and d.path is None:
        add(f"data.name={d.name!r} reads a file: set data.path=<jsonl or parquet file>")
    if d.path is not None and not d.path.endswith(DATA_SUFFIXES):
        add(f"data.path={d.path!r} must be a {' / '.join(DATA_SUFFIXES)} file")
    if d.max_prompt_len < 1:
        add(f"data.max_prompt_len must be >= 1 (got {d.max_prompt_len})")
    if d.name == "tiny_arith":
        if d.arith.max_operand < 0 or d.arith.max_answer < 0:
            add("data.arith.max_operand and max_answer must be >= 0")
        if not d.arith.ops:
            add("data.arith.ops must list at least one operator")
    if r.grader not in GRADERS:
        add(f"reward.grader={r.grader!r} is unknown; choose one of {', '.join(GRADERS)}")
    if r.timeout_s <= 0:
        add(f"reward.timeout_s must be > 0 (got {r.timeout_s})")
    if e.grader not in GRADERS:
        add(f"eval.grader={e.grader!r} is unknown; choose one of {', '.join(GRADERS)}")
    if e.every_steps < 0:
        add(f"eval.every_steps must be >= 0 (got {e.every_steps}; 0: no periodic evaluation)")
    if e.name != "none":
        if e.dataset is None:
            add(f"eval.name={e.name!r} needs eval.dataset=<jsonl file> (or eval=none)")
        if e.samples_per_problem < 1:
            add(f"eval.samples_per_problem must be >= 1 (got {e.samples_per_problem})")
        bad_k = [k for k in e.k if not 1 <= k <= e.samples_per_problem]
        if bad_k or not e.k:
            add(f"eval.k values must be in 1..samples_per_problem={e.samples_per_problem} (got {list(e.k)})")
        _check_sampling("eval.sampling", e.sampling, add)


def _check_run(cfg: Config, add: Add) -> None:
    t, s, q, eng = cfg.train, cfg.sync, cfg.quant, cfg.engine
    if t.steps < 1:
        add(f"train.steps must be >= 1 (got {t.steps})")
    if t.micro_batch_size < 1:
        add(f"train.micro_batch_size must be >= 1 (got {t.micro_batch_size})")
    if t.checkpoint_every < 0:
        add(f"train.checkpoint_every must be >= 0 (got {t.checkpoint_every}; 0: never)")
    if t.keep_checkpoints < 1:
        add(f"train.keep_checkpoints must be >= 1 (got {t.keep_checkpoints})")
    if t.log_every < 1:
        add(f"train.log_every must be >= 1 (got {t.log_every})")
    if s.bucket_bytes <= 0:
        add(f"sync.bucket_bytes must be > 0 (got {s.bucket_bytes})")
    if s.pause_mode not in PAUSE_MODES:
        add(f"sync.pause_mode={s.pause_mode!r} is unknown; choose one of {', '.join(PAUSE_MODES)}")
    if s.naming not in SYNC_NAMINGS:
        add(f"sync.naming={s.naming!r} is unknown; choose one of {', '.join(SYNC_NAMINGS)}")
    if s.timeout_s <= 0:
        add(f"sync.timeout_s must be > 0 (got {s.timeout_s})")
    if not s.group_name:
        add("sync.group_name must not be empty")
    if len(q.block_size) != 2 or any(b < 1 for b in q.block_size):
        add(f"quant.block_size must be two positive sizes (got {list(q.block_size)})")
    if q.scale_fmt not in SCALE_FORMATS:
        add(f"quant.scale_fmt={q.scale_fmt!r} is unknown; choose one of {', '.join(SCALE_FORMATS)}")
    if eng.max_batch_size < 1 or eng.max_concurrency < 1:
        add("engine.max_batch_size and engine.max_concurrency must be >= 1")
    if eng.retries < 0:
        add(f"engine.retries must be >= 0 (got {eng.retries})")
    if eng.startup_timeout_s <= 0 or eng.request_timeout_s <= 0:
        add("engine.startup_timeout_s and engine.request_timeout_s must be > 0")
    if not cfg.run.dir:
        add("run.dir must not be empty")


def _check_ports(cfg: Config, add: Add) -> None:
    c, eng = cfg.cluster, cfg.engine
    engines = max(1, cfg.parallel.rollout.num_engines)
    named = {
        "cluster.master_port": c.master_port,
        "cluster.weight_sync_port": c.weight_sync_port,
        "engine.port": eng.port,
    }
    bad = [f"{k}={v}" for k, v in named.items() if not 1 <= v <= 65535]
    if bad:
        add(f"ports must be in 1..65535: {', '.join(bad)}")
        return
    if eng.port + engines - 1 > 65535:
        add(f"engine.port={eng.port} + {engines} engines runs past port 65535")
    engine_ports = range(eng.port, eng.port + engines)
    if c.master_port == c.weight_sync_port:
        add(f"cluster.master_port and cluster.weight_sync_port are both {c.master_port}: use two ports")
    for key in ("cluster.master_port", "cluster.weight_sync_port"):
        if named[key] in engine_ports:
            add(
                f"{key}={named[key]} collides with the engine ports {eng.port}..{eng.port + engines - 1} "
                "(engine i listens on engine.port + i)"
            )


def _check_built(cfg: Config, add: Add) -> None:
    """Settings the schema plans for but this version cannot run yet: refuse them before anything starts."""
    if cfg.parallel.train.backend.value == "megatron":
        add(
            "parallel.train.backend=megatron: the Megatron-core train engine is not built yet; only fsdp "
            "trains (`dsv4rl plan` and `--cfg` still show the Megatron layout)"
        )
    if cfg.quant.rollout_weights.value == "fp8" or cfg.quant.expert_weights.value in ("fp8", "fp4"):
        add(
            "quant: FP8/FP4 weights on the wire are not built yet (the sync sends the trainer's dtype); "
            "use quant=none"
        )


def _check_paths(cfg: Config, add: Add) -> None:
    m = cfg.model
    if m.path is not None:
        path = Path(m.path).expanduser()
        if not path.is_dir():
            add(
                f"model.path {m.path!r} does not exist (resolved: {path.resolve()}): download the model, a "
                "Hugging Face directory with config.json, and pass model.path=<that directory>"
            )
        elif not (path / "config.json").is_file():
            add(
                f"model.path {m.path!r} has no config.json: point model.path at a Hugging Face "
                "model directory"
            )
    tok = m.tokenizer
    path_like = tok != "arith_chars" and tok != m.path and tok.startswith(("/", ".", "~"))
    if path_like and not Path(tok).expanduser().is_dir():
        add(f"model.tokenizer {tok!r} does not exist: pass model.tokenizer=<tokenizer directory>")
    if cfg.data.path is not None and not Path(cfg.data.path).expanduser().is_file():
        add(
            f"data.path {cfg.data.path!r} does not exist (resolved: {Path(cfg.data.path).resolve()}): pass "
            "data.path=<jsonl or parquet file> or set DSV4RL_DATA_DIR to the data directory"
        )
    e = cfg.eval
    if e.name != "none" and e.dataset is not None and not Path(e.dataset).expanduser().is_file():
        add(
            f"eval.dataset {e.dataset!r} does not exist (resolved: {Path(e.dataset).resolve()}): pass "
            "eval.dataset=<jsonl file>, set DSV4RL_DATA_DIR, or use eval=none"
        )
    c = cfg.cluster
    if c.nnodes > 1 and c.master_addr in LOOPBACK:
        add(
            f"cluster.master_addr={c.master_addr} is a loopback address but cluster.nnodes={c.nnodes}: "
            "set cluster.master_addr=<node 0 host> (or export MASTER_ADDR)"
        )
    if c.nnodes > 1 and not c.node_addrs:
        add(
            f"cluster.node_addrs is empty but cluster.nnodes={c.nnodes}: trainer rank 0 on node 0 reaches "
            f"the engines on {_engine_nodes_text(cfg)} at their node's address; {NODE_ADDRS_FIX}"
        )
    loopback = [a for a in c.node_addrs if a in LOOPBACK]
    if c.nnodes > 1 and loopback:
        add(
            f"cluster.node_addrs has loopback address(es) {loopback} but cluster.nnodes={c.nnodes}: other "
            "nodes cannot reach them; give each node's hostname or IP"
        )


_CHECKS: list[Callable[[Config, Add], None]] = [
    _check_train_layout,
    _check_nodes_and_rollout,
    _check_cluster_addresses,
    _check_comm,
    _check_algo,
    _check_optim,
    _check_model,
    _check_data_reward_eval,
    _check_run,
    _check_ports,
]
