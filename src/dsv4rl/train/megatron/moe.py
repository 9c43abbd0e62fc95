"""DeepSeek-V4's MoE in megatron-core's `MoELayer`: its dispatcher (all-gather on CPU, all-to-all on
GPUs), `SequentialMLP` experts (clamped SwiGLU) and shared expert, with DeepSeek-V4's two routers.

Both routers score experts with sqrt(softplus(x . W_g)) in float32 and weight the chosen ones by their
scores renormalised over the top-k, times `route_scale`. They differ in the choice:
- score routing: top-k of (score + bias), the fp32 bias steering selection only (never updated here);
- hash routing (the first layers): a fixed `tid2eid[token_id]` table, so the router needs the token
  ids of the micro-batch, which the block hands it (`token_ids`) before the layer runs.
A token sent twice to one expert (a degenerate table) gets the sum of both weights, like transformers.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.transformer.moe.router import Router
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor


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

    def choose(self, scores: Tensor) -> Tensor:
        return torch.topk(scores + self.expert_bias, self.topk, dim=-1, sorted=False).indices


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


def moe_spec(hash_routed: bool, vocab_size: int, route_scale: float) -> ModuleSpec:
    """megatron-core's MoE layer spec (local linears) with a DeepSeek-V4 router class."""
    spec = get_moe_module_spec(use_te=False, num_experts=1, moe_grouped_gemm=False)
    if hash_routed:
        spec.submodules.router = functools.partial(HashRouter, route_scale=route_scale, vocab_size=vocab_size)
    else:
        spec.submodules.router = functools.partial(ScoreRouter, route_scale=route_scale)
    return spec
