"""DeepSeek-V4's MoE in megatron-core's `MoELayer`: its dispatcher (all-gather on CPU, all-to-all on
GPUs), experts (clamped SwiGLU; grouped GEMM with Transformer Engine, else `SequentialMLP`) and shared
expert, with DeepSeek-V4's two routers.

Both routers score experts with sqrt(softplus(x . W_g)) in float32 and weight the chosen ones by their
scores renormalised over the top-k, times `route_scale`. They differ in the choice:
- score routing: top-k of (score + bias), the fp32 bias steering selection only (never updated here),
  or the rollout's experts with algo.routing_replay (their weights still these scores);
- hash routing (the first layers): a fixed `tid2eid[token_id]` table, so the router needs the token
  ids of the micro-batch, which the block hands it (`token_ids`) before the layer runs.
A token sent twice to one expert (a degenerate table) gets the sum of both weights, like transformers.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import TEGroupedMLP
from megatron.core.transformer.moe.router import Router
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

from dsv4rl.model.replay import ReplayCounts, replayed_experts


class DeepseekV4Router(Router):
    def __init__(self, config: TransformerConfig, route_scale: float, pg_collection=None) -> None:  # noqa: ANN001
        super().__init__(config, pg_collection=pg_collection)
        self.topk = config.moe_router_topk
        self.route_scale = route_scale

    def scores(self, hidden: Tensor) -> Tensor:
        flat = hidden.reshape(-1, self.config.hidden_size)
        logits = F.linear(flat.float(), self.weight.float())
        return F.softplus(logits).sqrt()

    def choose(self, scores: Tensor) -> Tensor:
        raise NotImplementedError

    def routing(self, scores: Tensor) -> tuple[Tensor, Tensor]:
        """(probs [tokens, experts], routing_map [tokens, experts]) as megatron's dispatchers expect."""
        chosen = self.choose(scores)
        weights = scores.gather(1, chosen)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.route_scale
        probs = torch.zeros_like(scores).scatter_add(1, chosen, weights)
        routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, chosen, True)
        return probs, routing_map

    def forward(self, hidden: Tensor, padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return self.routing(self.scores(hidden))


class ScoreRouter(DeepseekV4Router):
    def __init__(self, config: TransformerConfig, route_scale: float, pg_collection=None) -> None:  # noqa: ANN001
        super().__init__(config, route_scale, pg_collection=pg_collection)
        self.register_buffer("expert_bias", torch.zeros(config.num_moe_experts, dtype=torch.float32))
        # algo.routing_replay: the rollout's experts of this rank's tokens [tokens, k] (NO_CHOICE rows: own
        # choice), set by the block around its MoE (dsv4rl.train.megatron.replay)
        self.replay: Tensor | None = None
        self.replay_counts: ReplayCounts | None = None

    def choose(self, scores: Tensor) -> Tensor:
        own = torch.topk(scores + self.expert_bias, self.topk, dim=-1, sorted=False).indices
        if self.replay is None:
            return own
        return replayed_experts(own, self.replay, self.replay_counts)


class HashRouter(DeepseekV4Router):
    def __init__(
        self,
        config: TransformerConfig,
        route_scale: float,
        vocab_size: int,
        pg_collection=None,  # noqa: ANN001
    ) -> None:
        super().__init__(config, route_scale, pg_collection=pg_collection)
        self.register_buffer("tid2eid", torch.zeros(vocab_size, self.topk, dtype=torch.int64))
        self.token_ids: Tensor | None = None

    def choose(self, scores: Tensor) -> Tensor:
        if self.token_ids is None:
            raise RuntimeError("hash routing needs the micro-batch's token ids: set router.token_ids first")
        return self.tid2eid[self.token_ids.reshape(-1)].long()


def grouped_experts_available() -> bool:
    """Whether Transformer Engine's grouped GEMM imports here: megatron-core's own check (its TE extension
    leaves the grouped linears None without TE). Without it megatron would fall back to the legacy
    `GroupedMLP` (the separate grouped_gemm package), which dsv4rl does not use."""
    from megatron.core.extensions import transformer_engine

    return transformer_engine.TEColumnParallelGroupedLinear is not None


def moe_spec(hash_routed: bool, vocab_size: int, route_scale: float, grouped: bool = False) -> ModuleSpec:
    """megatron-core's MoE layer spec with a DeepSeek-V4 router class: the experts in one grouped GEMM
    (`TEGroupedMLP`, config.moe_grouped_gemm) where Transformer Engine is present, else `SequentialMLP`
    (a loop over the local experts); the shared expert in local linears either way. Both expert modules
    write the same checkpoint (megatron's stacked `experts.experts.linear_fc*` tensors)."""
    spec = get_moe_module_spec(use_te=False, num_experts=1, moe_grouped_gemm=False)
    if grouped:
        if not grouped_experts_available():
            raise RuntimeError(
                "grouped experts (moe_grouped_gemm) need Transformer Engine's grouped linears, which do not "
                "import here: install Transformer Engine (`make install GPU=1`) or build without grouped GEMM"
            )
        from megatron.core.extensions.transformer_engine import (
            TEColumnParallelGroupedLinear,
            TERowParallelGroupedLinear,
        )

        experts = MLPSubmodules(
            linear_fc1=TEColumnParallelGroupedLinear, linear_fc2=TERowParallelGroupedLinear
        )
        experts.activation_func = spec.submodules.experts.submodules.activation_func
        spec.submodules.experts = ModuleSpec(module=TEGroupedMLP, submodules=experts)
    if hash_routed:
        spec.submodules.router = functools.partial(HashRouter, route_scale=route_scale, vocab_size=vocab_size)
    else:
        spec.submodules.router = functools.partial(ScoreRouter, route_scale=route_scale)
    return spec
