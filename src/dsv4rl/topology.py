"""Where everything of a run lives, computed once from the recipe: nodes and their roles, engines with their
ports and URLs, trainer ranks with their parallel coordinates, and the weight-sync senders.

Pure: no process, no socket. The planner (what each node starts), the validation rules (ports, addresses)
and the trainer (which engines to talk to, which ranks send weights) all read this one answer, so nothing
is both handed to a child by environment variable and recomputed by it.

Node layout: with `parallel.rollout.nnodes == 0` (or colocated) every node runs trainer ranks and an even
share of the engines; otherwise (disaggregated) nodes `0 .. train.nnodes-1` train and the next
`rollout.nnodes` nodes serve rollouts. Engines are numbered globally in node order; a node's engine `local`
listens on `engine.port + local * stride` (SGLang's attention DP opens more ports per engine, so engines are
spread further apart). Ranks follow megatron-core's default order, tensor innermost and pipeline outermost:
`rank = tp + TP * (cp + CP * (dp + DP * pp))`; experts split the same ranks as expert-tensor x expert x
expert-data inside each stage.

Weight-sync senders: a pipeline-parallel trainer never gathers the whole model on one rank; the first rank
of every stage broadcasts its stage itself, over a group of its own with every engine (the layout of the
reference DeepSeek-V4 run, and of slime/Miles). Each group needs its own name (SGLang keeps groups in a
dict keyed by name) and its own rendezvous port, hosted on the source's node. Stage `s` runs on ranks
`s * n .. (s + 1) * n - 1` with `n = world / pipeline_parallel`; its source is rank `s * n`. The Megatron
engine checks that its own pipeline group agrees.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dsv4rl.config.choices import RolloutEngineKind, SyncTransport, TrainBackend
from dsv4rl.config.compose import ConfigError
from dsv4rl.config.schema import Config

WILDCARD = ("0.0.0.0", "::")
LOOPBACK = ("127.0.0.1", "localhost", "::1")
# SGLang with attention DP opens port + 233 .. port + 240 (ZMQ_TCP_PORT_DELTA in its server_args.py): a
# node's engines then sit 10 ports apart so no engine's range meets another's port.
ATTN_DP_PORT_OFFSETS = range(233, 241)
ATTN_DP_ENGINE_STRIDE = 10


@dataclass(frozen=True)
class EngineSlot:
    """One rollout engine: global `index`, the `node` it runs on and its `local` index there."""

    index: int
    node: int
    local: int
    port: int
    url: str | None  # http://<node address>:<port>; None while cluster.node_addrs does not name its node

    @property
    def name(self) -> str:
        return f"engine-{self.index}"


@dataclass(frozen=True)
class RankPlace:
    """One trainer rank: its node and local rank, and its coordinates in each parallel dimension."""

    rank: int
    node: int
    local_rank: int
    tensor: int
    context: int
    data: int
    pipeline: int
    expert: int


@dataclass(frozen=True)
class NodeRoles:
    node: int
    address: str | None
    ranks: tuple[int, ...]  # trainer ranks on this node (empty: a rollout-only node)
    engines: tuple[int, ...]  # global indices of the engines it serves

    @property
    def roles(self) -> list[str]:
        return (["trainer"] if self.ranks else []) + (["rollout"] if self.engines else [])


@dataclass(frozen=True)
class SyncSource:
    """One sender of a weight sync: it hosts the rendezvous of `group_name` at `address:port`."""

    stage: int
    rank: int  # global trainer rank
    node: int  # the node it runs on (trainer nodes are 0 .. parallel.train.nnodes - 1)
    address: str  # how the engines reach that node
    port: int  # cluster.weight_sync_port + stage
    group_name: str  # sync.group_name, then "-pp<stage>" for the stages after the first


@dataclass(frozen=True)
class Topology:
    nodes: tuple[NodeRoles, ...]
    engines: tuple[EngineSlot, ...]
    ranks: tuple[RankPlace, ...]
    sync_sources: tuple[SyncSource, ...]

    def engines_on(self, node: int) -> list[EngineSlot]:
        return [engine for engine in self.engines if engine.node == node]

    def trainer_nodes(self) -> list[int]:
        return [n.node for n in self.nodes if n.ranks]

    def engine_urls(self) -> list[str]:
        """Every engine's base URL by global index; ConfigError naming the fix when one is unresolved."""
        if any(engine.url is None for engine in self.engines):
            raise ConfigError(
                f"cluster.node_addrs lists {sum(n.address is not None for n in self.nodes)} address(es) but "
                f"cluster.nnodes={len(self.nodes)}: the engines' URLs need every node's hostname or IP, in "
                "node-rank order; pass cluster.node_addrs=[host0,host1,...] "
                "(launch/slurm/dapo_math_4node.sbatch builds it from `scontrol show hostnames`)"
            )
        return [str(engine.url) for engine in self.engines]

    def remote_engines(self, node: int) -> list[EngineSlot]:
        """The engines a trainer node waits for that run on other nodes (none for a rollout-only node)."""
        if node not in self.trainer_nodes():
            return []
        return [engine for engine in self.engines if engine.node != node]


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


def stage_layers(cfg: Config) -> list[int]:
    """Decoder layers per pipeline stage: `last_stage_layers` on the last, the rest split evenly."""
    t, layers = cfg.parallel.train, num_layers(cfg)
    if t.pipeline_parallel == 1:
        return [layers]
    last = t.last_stage_layers if t.last_stage_layers is not None else layers // t.pipeline_parallel
    return [(layers - last) // (t.pipeline_parallel - 1)] * (t.pipeline_parallel - 1) + [last]


def num_routed_experts(cfg: Config) -> int:
    m = cfg.model
    return m.n_routed_experts if m.n_routed_experts is not None else m.tiny.n_routed_experts


def on_one_machine(cfg: Config) -> bool:
    """Several nodes whose addresses are all loopback: every node runs on this machine (a test of a
    multi-node layout), so loopback engines and rendezvous reach every node."""
    c = cfg.cluster
    return c.nnodes > 1 and len(c.node_addrs) == c.nnodes and all(a in LOOPBACK for a in c.node_addrs)


def _disaggregated(cfg: Config) -> bool:
    return not cfg.parallel.colocate and cfg.parallel.rollout.nnodes > 0


def engine_nodes(cfg: Config) -> range:
    if _disaggregated(cfg):
        start = cfg.parallel.train.nnodes
        return range(start, start + cfg.parallel.rollout.nnodes)
    return range(cfg.cluster.nnodes)


def engines_on_node(cfg: Config, node_rank: int) -> list[int]:
    """Global indices of the engines node `node_rank` runs (contiguous blocks, in node order)."""
    nodes = engine_nodes(cfg)
    if node_rank not in nodes:
        return []
    per_node = math.ceil(cfg.parallel.rollout.num_engines / len(nodes))
    first = (node_rank - nodes.start) * per_node
    return list(range(first, min(first + per_node, cfg.parallel.rollout.num_engines)))


def engine_port_layout(cfg: Config) -> tuple[int, range]:
    """(ports between a node's engines, extra ports each engine opens above its own)."""
    ro = cfg.parallel.rollout
    if ro.engine == RolloutEngineKind.sglang and ro.data_parallel > 1:
        return ATTN_DP_ENGINE_STRIDE, ATTN_DP_PORT_OFFSETS
    return 1, range(0)


def engine_port(cfg: Config, local: int) -> int:
    """The port of a node's `local`-th engine (spread out when SGLang's attention DP adds ports)."""
    return cfg.engine.port + local * engine_port_layout(cfg)[0]


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _engine_url(cfg: Config, node: int, local: int) -> str | None:
    if cfg.cluster.nnodes <= 1:  # one node: the engine's own bind address, loopback for a wildcard
        host = "127.0.0.1" if cfg.engine.host in WILDCARD else cfg.engine.host
    elif len(cfg.cluster.node_addrs) == cfg.cluster.nnodes:
        host = cfg.cluster.node_addrs[node]
    else:
        return None
    return f"http://{url_host(host)}:{engine_port(cfg, local)}"


def rank_place(cfg: Config, rank: int) -> RankPlace:
    """Where trainer `rank` runs and its coordinates (megatron's order; FSDP: data-parallel only)."""
    t = cfg.parallel.train
    node, local_rank = divmod(rank, max(t.nproc_per_node, 1))
    if t.backend != TrainBackend.megatron:
        return RankPlace(rank, node, local_rank, 0, 0, rank, 0, 0)
    world = t.nnodes * t.nproc_per_node
    tp, cp, pp = t.tensor_parallel, t.context_parallel, t.pipeline_parallel
    data_size = max(world // max(tp * cp * pp, 1), 1)
    tensor = rank % tp
    context = rank // tp % cp
    data = rank // (tp * cp) % data_size
    pipeline = rank // (tp * cp * data_size)
    per_stage = world // max(pp, 1)
    expert = rank % per_stage // t.expert_tensor_parallel % t.expert_parallel
    return RankPlace(rank, node, local_rank, tensor, context, data, pipeline, expert)


def topology(cfg: Config) -> Topology:
    """The recipe's topology (any node's view: it does not depend on `cluster.node_rank`)."""
    c, t = cfg.cluster, cfg.parallel.train
    engines = tuple(
        EngineSlot(index, node, local, engine_port(cfg, local), _engine_url(cfg, node, local))
        for node in engine_nodes(cfg)
        for local, index in enumerate(engines_on_node(cfg, node))
    )
    ranks = tuple(rank_place(cfg, rank) for rank in range(t.nnodes * t.nproc_per_node))
    nodes = tuple(
        NodeRoles(
            node=node,
            address=c.node_addrs[node] if node < len(c.node_addrs) else None,
            ranks=tuple(r.rank for r in ranks if r.node == node),
            engines=tuple(e.index for e in engines if e.node == node),
        )
        for node in range(c.nnodes)
    )
    return Topology(nodes, engines, ranks, tuple(weight_sync_sources(cfg)))


def sync_transport(cfg: Config) -> SyncTransport:
    """Colocated engines take the weights by tensor handles (no group, no port); others by broadcast."""
    return SyncTransport.tensor if cfg.parallel.colocate else SyncTransport.broadcast


def pipeline_stages(cfg: Config) -> int:
    """Pipeline stages of the trainer (the FSDP engine has one)."""
    train = cfg.parallel.train
    return train.pipeline_parallel if train.backend == TrainBackend.megatron else 1


def stage_group_name(base: str, stage: int) -> str:
    return base if stage == 0 else f"{base}-pp{stage}"


def weight_sync_sources(cfg: Config) -> list[SyncSource]:
    """The sources of a recipe, by stage. Stage 0's is rank 0 at `cluster.master_addr`; a later stage's
    source on another node is reached at `cluster.node_addrs[node]` (validation requires them then)."""
    train, cluster = cfg.parallel.train, cfg.cluster
    stages = pipeline_stages(cfg)
    ranks_per_stage = train.nnodes * train.nproc_per_node // stages
    sources = []
    for stage in range(stages):
        rank = stage * ranks_per_stage
        node = rank // max(train.nproc_per_node, 1)
        if node == 0:
            address = cluster.master_addr
        elif node < len(cluster.node_addrs):
            address = cluster.node_addrs[node]
        else:
            address = ""  # unresolved: check_weight_sync_sources refuses the recipe before start
        sources.append(
            SyncSource(
                stage=stage,
                rank=rank,
                node=node,
                address=address,
                port=cluster.weight_sync_port + stage,
                group_name=stage_group_name(cfg.sync.group_name, stage),
            )
        )
    return sources
