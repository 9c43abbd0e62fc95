"""Where the weights leave the trainer: one source rank per pipeline stage, each with its own group.

A pipeline-parallel trainer never gathers the whole model on one rank: the first rank of every stage
gathers its stage's tensor- and expert-parallel shards and broadcasts them itself, over a process group
of its own with every engine (the layout of the reference DeepSeek-V4 run, and of slime/Miles). Each
group needs its own name (SGLang keeps groups in a dict keyed by name) and its own rendezvous port,
hosted on the source's node, which the engines must be able to reach.

Ranks follow megatron-core's default order (tensor, context, expert, data inside, pipeline outermost),
so stage `s` runs on ranks `s * n .. (s + 1) * n - 1` with `n = world / pipeline_parallel`, and its
source is rank `s * n`. The Megatron engine checks that its own pipeline group agrees.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv4rl.config.schema import Config, SyncTransport, TrainBackend

__all__ = ["SyncSource", "sync_transport", "weight_sync_sources"]


@dataclass(frozen=True)
class SyncSource:
    """One sender of a weight sync: it hosts the rendezvous of `group_name` at `address:port`."""

    stage: int
    rank: int  # global trainer rank
    node: int  # the node it runs on (trainer nodes are 0 .. parallel.train.nnodes - 1)
    address: str  # how the engines reach that node
    port: int  # cluster.weight_sync_port + stage
    group_name: str  # sync.group_name, then "-pp<stage>" for the stages after the first


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
