"""The discrete choices of transformers' DeepSeek-V4, recorded and replayed.

Two choices inside a forward depend on tiny numeric differences: the experts of a score-routed MoE
layer (top-k of score + bias) and the compressed entries the CSA lightning indexer keeps (top-k of the
index scores). An engine and a trainer that round differently can choose differently on the same tokens.
SGLang 0.5.23 returns its choices (`return_routed_experts`, `return_indexer_topk`); the reference engine
records them here with forward hooks, in SGLang's layout, and the trainer replays them here: the chosen
indices are the rollout's, the routing weights still the trainer's scores gathered at those indices, so
the router's gradient flows. Hash-routed layers choose by the token id alone, so they need no replay.

Layouts (per sequence, one row per forwarded position): routed experts [rows, num_hidden_layers, top_k]
(hash-routed layers' rows are zeros, as SGLang never writes them), indexer top-k [rows, CSA layers,
index_topk] (-1 where fewer entries are visible). In training batches a position without a rollout row
holds `NO_CHOICE`: there the trainer's own choice stands.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields

import torch
from torch import Tensor

CSA = "compressed_sparse_attention"
HASH_MOE = "hash_moe"
NO_CHOICE = -2  # a position the rollout did not report (padding, the last token): the trainer's own choice


def score_routed_layers(config) -> list[int]:  # noqa: ANN001 (a transformers DeepseekV4Config)
    """Indices of the MoE layers that route by score (the ones whose choice can flip)."""
    return [i for i, kind in enumerate(config.mlp_layer_types) if kind != HASH_MOE]


def hash_routed_layers(config) -> list[int]:  # noqa: ANN001
    return [i for i, kind in enumerate(config.mlp_layer_types) if kind == HASH_MOE]


def indexer_layers(config) -> list[int]:  # noqa: ANN001
    """Indices of the CSA layers (each has a lightning indexer), in order: SGLang's indexer-layer axis."""
    return [i for i, kind in enumerate(config.layer_types) if kind == CSA]


def _router(model: torch.nn.Module, layer: int) -> torch.nn.Module:
    return model.model.layers[layer].mlp.gate


def _indexer(model: torch.nn.Module, layer: int) -> torch.nn.Module:
    return model.model.layers[layer].self_attn.compressor.indexer


def pad_topk(indices: Tensor, width: int) -> Tensor:
    """[..., k] -> [..., width], padded with -1 (transformers keeps min(index_topk, entries) columns)."""
    missing = width - indices.shape[-1]
    if missing <= 0:
        return indices[..., :width]
    return torch.nn.functional.pad(indices, (0, missing), value=-1)


def differs(own: Tensor, replayed: Tensor) -> Tensor:
    """[..., k] x [..., k] -> [...] bool: the two index sets differ (order does not matter)."""
    return (own.sort(dim=-1).values != replayed.sort(dim=-1).values).any(dim=-1)


class ChoiceRecorder:
    """Forward hooks that keep the last forward's choices: `take()` gives routed experts [B, S, L, k]
    and indexer top-k [B, S, C, index_topk] (None for what was not asked)."""

    def __init__(self, model: torch.nn.Module, routed: bool, indexer: bool) -> None:
        config = model.config
        self.num_layers, self.top_k = config.num_hidden_layers, config.num_experts_per_tok
        self.index_topk = config.index_topk
        self.score_layers = score_routed_layers(config) if routed else []
        self.csa_layers = indexer_layers(config) if indexer else []
        self.routed = routed
        self.indexer = indexer
        self._routes: dict[int, Tensor] = {}
        self._topk: dict[int, Tensor] = {}
        self._handles = [
            _router(model, layer).register_forward_hook(self._route_hook(layer))
            for layer in self.score_layers
        ] + [
            _indexer(model, layer).register_forward_hook(self._topk_hook(slot))
            for slot, layer in enumerate(self.csa_layers)
        ]

    def _route_hook(self, layer: int):  # noqa: ANN202
        def hook(module: torch.nn.Module, args: tuple, output: tuple) -> None:
            batch, seq = args[0].shape[:2]
            self._routes[layer] = output[2].detach().view(batch, seq, -1)

        return hook

    def _topk_hook(self, slot: int):  # noqa: ANN202
        def hook(module: torch.nn.Module, args: tuple, output: Tensor) -> None:
            self._topk[slot] = pad_topk(output.detach(), self.index_topk)

        return hook

    def take(self) -> tuple[Tensor | None, Tensor | None]:
        routes = topk = None
        if self.routed and self._routes:
            first = next(iter(self._routes.values()))
            routes = torch.zeros(*first.shape[:2], self.num_layers, self.top_k, dtype=torch.int32)
            for layer, chosen in self._routes.items():
                routes[:, :, layer] = chosen.to(torch.int32)
        if self.indexer and self._topk:
            topk = torch.stack([self._topk[slot] for slot in range(len(self.csa_layers))], dim=2)
            topk = topk.to(torch.int32)
        self._routes.clear()
        self._topk.clear()
        return routes, topk

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


@dataclass
class ReplayCounts:
    """Replayed decisions and how many of them the trainer would have made differently."""

    routed_differ: int = 0
    routed_total: int = 0
    indexer_differ: int = 0
    indexer_total: int = 0

    def add(self, other: ReplayCounts) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_tensor(self) -> Tensor:
        return torch.tensor([getattr(self, f.name) for f in fields(self)], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, values: Tensor) -> ReplayCounts:
        return cls(*(int(v) for v in values.tolist()))


def replay_metrics(counts: ReplayCounts, routing: bool, indexer: bool) -> dict[str, float]:
    """metrics.jsonl's `routing_replay_diff_fraction` / `indexer_replay_diff_fraction`: the share of
    replayed decisions (token x layer) whose rollout choice the trainer would not have made itself."""
    out = {}
    if routing:
        out["routing_replay_diff_fraction"] = counts.routed_differ / max(counts.routed_total, 1)
        out["routing_replay_decisions"] = float(counts.routed_total)
    if indexer:
        out["indexer_replay_diff_fraction"] = counts.indexer_differ / max(counts.indexer_total, 1)
        out["indexer_replay_decisions"] = float(counts.indexer_total)
    return out


def replayed_experts(own: Tensor, replayed: Tensor, counts: ReplayCounts | None) -> Tensor:
    """The experts of a score-routed layer with the rollout's choice where it has one: own [N, k],
    replayed [N, k] (NO_CHOICE rows keep `own`) -> [N, k]; the decisions counted into `counts`."""
    present = (replayed >= 0).all(dim=-1)
    chosen = torch.where(present.unsqueeze(-1), replayed.to(own.device, own.dtype), own)
    if counts is not None:
        counts.routed_differ += int((differs(own, chosen) & present).sum())
        counts.routed_total += int(present.sum())
    return chosen


def replay_routes(
    own: Tensor, replayed: Tensor, scores: Tensor, scale: float, counts: ReplayCounts | None
) -> tuple[Tensor, Tensor]:
    """(indices, weights) of a score-routed layer with the rollout's choice where it has one
    (`replayed_experts`); scores [N, E] are the trainer's (differentiable). The weights are the trainer's
    scores at the chosen experts, renormalised and scaled as the router does."""
    chosen = replayed_experts(own, replayed, counts)
    weights = scores.gather(1, chosen)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return chosen, weights * scale


def replay_topk(own: Tensor, replayed: Tensor, counts: ReplayCounts | None) -> Tensor:
    """The indexer's kept entries with the rollout's where it has them: own [..., k'] (-1 = none),
    replayed [..., K] (-1 padding; rows of NO_CHOICE keep `own`) -> [..., max(k', K)]."""
    width = max(own.shape[-1], replayed.shape[-1])
    own, replayed = pad_topk(own, width), pad_topk(replayed.to(own.dtype), width)
    present = (replayed != NO_CHOICE).all(dim=-1)
    chosen = torch.where(present.unsqueeze(-1), replayed, own)
    if counts is not None:
        counts.indexer_differ += int((differs(own, chosen) & present).sum())
        counts.indexer_total += int(present.sum())
    return chosen


@contextmanager
def replaying(
    model: torch.nn.Module,
    routes: Tensor | None,
    topk: Tensor | None,
    counts: ReplayCounts | None = None,
) -> Iterator[None]:
    """Forwards of `model` (transformers' DeepSeek-V4) inside the block use the rollout's choices:
    routes [B, T, num_hidden_layers, k] for the score-routed layers, topk [B, T, CSA layers, K] for the
    indexers (T >= the forward's sequence length; NO_CHOICE rows keep the trainer's own choice)."""
    config = model.config
    handles = []
    if routes is not None:
        for layer in score_routed_layers(config):
            handles.append(
                _router(model, layer).register_forward_hook(_router_hook(routes[:, :, layer], counts))
            )
    if topk is not None:
        for slot, layer in enumerate(indexer_layers(config)):
            handles.append(
                _indexer(model, layer).register_forward_hook(_indexer_hook(topk[:, :, slot], counts))
            )
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _router_hook(routes: Tensor, counts: ReplayCounts | None):  # noqa: ANN202
    def hook(module: torch.nn.Module, args: tuple, output: tuple) -> tuple:
        logits, _, own = output
        batch, seq = args[0].shape[:2]
        replayed = routes[:batch, :seq].reshape(batch * seq, -1).to(own.device)
        chosen, weights = replay_routes(
            own, replayed, module.score_fn(logits), module.routed_scaling_factor, counts
        )
        return logits, weights, chosen

    return hook


def _indexer_hook(topk: Tensor, counts: ReplayCounts | None):  # noqa: ANN202
    def hook(module: torch.nn.Module, args: tuple, output: Tensor) -> Tensor:
        batch, seq = output.shape[:2]
        return replay_topk(output, topk[:batch, :seq].to(output.device), counts)

    return hook
