"""Routing and indexer replay in the trainer (algo.routing_replay, algo.indexer_replay).

The rollout keeps the engine's choices per sample (`Sample.routed_experts`, `Sample.indexer_topk`); the
batch holds them per input position (`TrainBatch`), flat per position. Here they are shaped with the
model's config and handed to the forward (`dsv4rl.model.replay.replaying`), and the decisions that
differed are counted for metrics.jsonl.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from dsv4rl.config.schema import AlgoConfig
from dsv4rl.model.replay import ReplayCounts, indexer_layers, replay_metrics, replaying
from dsv4rl.train.batch import TrainBatch


def shaped_choices(batch: TrainBatch, hf_config, algo: AlgoConfig) -> tuple[Tensor | None, Tensor | None]:  # noqa: ANN001
    """(routes [B, T, layers, top_k], topk [B, T, CSA layers, index_topk]) of the replays that are on; an
    error naming the field when the rollout did not carry what a replay needs."""
    routes = topk = None
    b, t = batch.input_ids.shape
    if algo.routing_replay:
        if batch.routed_experts is None:
            raise ValueError("algo.routing_replay is on but the batch has no routed_experts from the rollout")
        routes = batch.routed_experts.view(b, t, hf_config.num_hidden_layers, -1)
        if routes.shape[-1] != hf_config.num_experts_per_tok:
            raise ValueError(
                f"routed_experts has {batch.routed_experts.shape[-1]} values per position, expected "
                f"num_hidden_layers x num_experts_per_tok = {hf_config.num_hidden_layers} x "
                f"{hf_config.num_experts_per_tok}: the engine serves another model"
            )
    if algo.indexer_replay:
        if batch.indexer_topk is None:
            raise ValueError("algo.indexer_replay is on but the batch has no indexer_topk from the rollout")
        layers = len(indexer_layers(hf_config))
        topk = batch.indexer_topk.view(b, t, layers, -1)
        if topk.shape[-1] != hf_config.index_topk:
            raise ValueError(
                f"indexer_topk has {batch.indexer_topk.shape[-1]} values per position, expected "
                f"{layers} CSA layers x index_topk {hf_config.index_topk}: the engine serves another model"
            )
    return routes, topk


@contextlib.contextmanager
def replay(
    model: torch.nn.Module, batch: TrainBatch, algo: AlgoConfig, counts: ReplayCounts | None
) -> Iterator[None]:
    """Forwards of transformers' DeepSeek-V4 `model` on `batch` with the rollout's choices (a no-op when
    both replays are off)."""
    if not (algo.routing_replay or algo.indexer_replay):
        yield
        return
    routes, topk = shaped_choices(batch, model.config, algo)
    with replaying(model, routes, topk, counts):
        yield


def reduced_metrics(counts: ReplayCounts, algo: AlgoConfig, device: torch.device) -> dict[str, float]:
    """The step's replay metrics over every data-parallel rank (collective when a group is up)."""
    if not (algo.routing_replay or algo.indexer_replay):
        return {}
    totals = counts.as_tensor().to(device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(totals)
    return replay_metrics(ReplayCounts.from_tensor(totals.cpu()), algo.routing_replay, algo.indexer_replay)
