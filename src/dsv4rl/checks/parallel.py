"""Parallel-layout rules: training and rollout layouts against the cluster, ports and the comm backend.

Kept apart from the run settings because these are the rules a cluster recipe most often trips over.
"""

from __future__ import annotations

from dsv4rl.checks.problems import Add
from dsv4rl.config.choices import AttentionImpl, ClusterKind, CommBackend, RolloutEngineKind, TrainBackend
from dsv4rl.config.schema import Config
from dsv4rl.topology import engine_port, engine_port_layout, num_layers, num_routed_experts, pipeline_stages


def _positive(add: Add, **values: float) -> bool:
    ok = True
    for key, value in values.items():
        if value < 1:
            add(f"{key.replace('__', '.')} must be >= 1 (got {value})")
            ok = False
    return ok


def check_train_layout(cfg: Config, add: Add) -> None:
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
        parallel__train__attention_query_chunk=t.attention_query_chunk,
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
            f"parallel.train.expert_parallel x expert_tensor_parallel ({t.expert_parallel} x "
            f"{t.expert_tensor_parallel}) must divide the ranks of one pipeline stage (world {world} / "
            f"pipeline_parallel {t.pipeline_parallel}): lower expert_parallel or give training more ranks "
            "(parallel.train.nnodes, nproc_per_node)"
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
        if t.attention == AttentionImpl.sparse:
            add(
                "parallel.train.attention=sparse is the megatron backend's attention; the fsdp backend runs "
                "transformers' DeepSeek-V4 attention, which is dense: set parallel.train.attention=auto (or "
                "dense), or parallel.train.backend=megatron"
            )
    if t.backend == TrainBackend.megatron:
        _check_megatron(cfg, add)
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


def check_megatron_heads(tensor_parallel: int, heads: int, o_groups: int, source: str, add: Add) -> None:
    """The Megatron engine splits attention heads and output groups over TP ranks."""
    if heads % tensor_parallel or o_groups % tensor_parallel:
        add(
            f"parallel.train.tensor_parallel={tensor_parallel} must divide the attention heads ({heads}) and "
            f"the output groups ({o_groups}) of {source}: the Megatron engine splits both over TP ranks"
        )


def _check_megatron(cfg: Config, add: Add) -> None:
    t = cfg.parallel.train
    if t.context_parallel != 1:
        add(
            f"parallel.train.context_parallel={t.context_parallel}: the Megatron engine has no context "
            "parallelism for DeepSeek-V4's compressed attention; set it to 1"
        )
    if t.expert_tensor_parallel != 1:
        add(
            f"parallel.train.expert_tensor_parallel={t.expert_tensor_parallel}: the Megatron engine keeps "
            "each expert whole on one rank (split experts over ranks with expert_parallel); set it to 1"
        )
    if cfg.model.path is None:
        tiny = cfg.model.tiny
        check_megatron_heads(t.tensor_parallel, tiny.num_attention_heads, tiny.o_groups, "model.tiny", add)


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


def check_nodes_and_rollout(cfg: Config, add: Add) -> None:
    t, r, c = cfg.parallel.train, cfg.parallel.rollout, cfg.cluster
    if c.nnodes < 1:
        add(f"cluster.nnodes must be >= 1 (got {c.nnodes})")
        return
    if not 0 <= c.node_rank < c.nnodes:
        add(f"cluster.node_rank={c.node_rank} must be in 0..{c.nnodes - 1} (cluster.nnodes={c.nnodes})")
    if c.gpus_per_node < 0:
        add(f"cluster.gpus_per_node must be >= 0 (got {c.gpus_per_node})")
    slurm_only = {"partition": c.partition, "account": c.account, "time_limit": c.time_limit}
    set_keys = [key for key, value in slurm_only.items() if value]
    for key in set_keys if c.kind != ClusterKind.slurm else []:
        add(
            f"cluster.{key} is a Slurm setting (`dsv4rl plan` prints it as an #SBATCH line) but "
            f"cluster.kind={c.kind.value}: use cluster=slurm_4node or cluster.kind=slurm, or drop it"
        )
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
    if cfg.parallel.colocate and c.nnodes > 1:
        add(
            f"parallel.colocate=true with cluster.nnodes={c.nnodes}: colocated weights travel as tensor "
            "handles (shared memory, CUDA IPC) that only engines on the sender's node can open, and every "
            "stage sends from its first rank; colocate on one node, or set parallel.colocate=false "
            "(weights by broadcast)"
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


def check_ports(cfg: Config, add: Add) -> None:
    c, eng = cfg.cluster, cfg.engine
    engines = max(1, cfg.parallel.rollout.num_engines)
    stages = pipeline_stages(cfg)  # one weight-sync group, and port, per pipeline stage
    named = {
        "cluster.master_port": c.master_port,
        "cluster.weight_sync_port": c.weight_sync_port,
        "engine.port": eng.port,
    }
    bad = [f"{k}={v}" for k, v in named.items() if not 1 <= v <= 65535]
    if bad:
        add(f"ports must be in 1..65535: {', '.join(bad)}")
        return
    sync_ports = set(range(c.weight_sync_port, c.weight_sync_port + stages))
    sync_text = (
        f"cluster.weight_sync_port={c.weight_sync_port}"
        if stages == 1
        else f"cluster.weight_sync_port={c.weight_sync_port} (+ 0..{stages - 1}, one per pipeline stage)"
    )
    if max(sync_ports) > 65535:
        add(f"{sync_text}: the weight-sync ports run past 65535")
    stride, extra = engine_port_layout(cfg)  # every engine as if on one node: the strictest case
    engine_ports = {engine_port(cfg, local) + e for local in range(engines) for e in (0, *extra)}
    if max(engine_ports) > 65535:
        add(f"engine.port={eng.port}: the ports of {engines} engines run past 65535 ({max(engine_ports)})")
    if c.master_port in sync_ports:
        add(
            f"cluster.master_port={c.master_port} is one of the weight-sync ports, {sync_text}: use two ports"
        )
    dp_ports = f"; attention DP adds port + {extra[0]}..{extra[-1]}" if extra else ""
    engine_text = (
        f"the engine ports {min(engine_ports)}..{max(engine_ports)} "
        f"(engine i listens on engine.port + {stride} i{dp_ports})"
    )
    if c.master_port in engine_ports:
        add(f"cluster.master_port={c.master_port} collides with {engine_text}")
    if sync_ports & engine_ports:
        add(f"{sync_text} collides with {engine_text}")


def check_comm(cfg: Config, add: Add) -> None:
    if cfg.comm.backend == CommBackend.nccl and cfg.cluster.gpus_per_node == 0:
        add("comm.backend=nccl needs GPUs but cluster.gpus_per_node=0 (CPU): use comm=cpu_gloo")
    for key in cfg.comm.env:
        if not key or "=" in key or " " in key:
            add(f"comm.env has an invalid environment variable name {key!r}")
