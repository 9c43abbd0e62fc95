"""mHC, manifold-constrained hyper-connections: the residual of DeepSeek-V4 is `hc_mult` streams.

Around each attention and MoE sub-block, the streams are collapsed into the sub-block's input with
`pre` weights, and the sub-block's output is written back with `post` weights plus a doubly
(column-exactly, row-approximately) stochastic mixing `comb` of the old streams, from Sinkhorn-Knopp:
X' = post (x) y + comb^T X. The weights come from a projection of the normalised, flattened streams.
Everything here runs in float32 like the released model. Parameters are replicated across
tensor-parallel ranks: they sit outside the split attention/MoE regions.

In bf16 the streams are bf16 but every mix is computed in float32 and rounded once, where SGLang
rounds: the collapse `sum_k pre_k X_k` (sglang/kernels/ops/layernorm/mhc.py:1937, the head's at
sglang/srt/models/deepseek_v4.py:674-679) and the expand `post (x) y + comb^T X` with float32 post and
comb (sglang/srt/models/deepseek_v4_mhc.py:602-606, `.type_as(x)` once at the end). transformers
rounds post and comb to bf16 and mixes in bf16
(transformers/models/deepseek_v4/modeling_deepseek_v4.py:1191-1199).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

from dsv4rl.model.sinkhorn import sinkhorn


def unweighted_rms_norm(x: Tensor, eps: float) -> Tensor:
    """x / rms(x) in float32, rounded once to x's dtype (SGLang's q kernel multiplies by the float32
    factor: sglang/kernels/jit/csrc/deepseek_v4/main_norm_rope.cuh:133-151; transformers rounds the
    factor to x's dtype first, modeling_deepseek_v4.py:72)."""
    wide = x.float()
    return (wide * torch.rsqrt(wide.square().mean(-1, keepdim=True) + eps)).to(x.dtype)


class HyperConnection(MegatronModule):
    """The mixing weights of one site (attention or MoE): returns (post, comb, collapsed input)."""

    def __init__(self, config: TransformerConfig, hc_mult: int, sinkhorn_iters: int, hc_eps: float) -> None:
        super().__init__(config)
        self.hc_mult, self.sinkhorn_iters, self.hc_eps = hc_mult, sinkhorn_iters, hc_eps
        self.norm_eps = config.layernorm_epsilon
        mixes = (2 + hc_mult) * hc_mult
        self.fn = torch.nn.Parameter(torch.zeros(mixes, hc_mult * config.hidden_size, dtype=torch.float32))
        self.base = torch.nn.Parameter(torch.zeros(mixes, dtype=torch.float32))
        self.scale = torch.nn.Parameter(torch.ones(3, dtype=torch.float32))

    def forward(self, streams: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """streams [B, S, N, D] -> post [B, S, N], comb [B, S, N, N], collapsed [B, S, D]."""
        batch, seq = streams.shape[:2]
        n = self.hc_mult
        flat = unweighted_rms_norm(streams.reshape(batch, seq, -1).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_scale, post_scale, comb_scale = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_scale + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_scale + post_b)
        comb = comb_w.view(*comb_w.shape[:-1], n, n) * comb_scale + comb_b.view(n, n)
        comb = sinkhorn(torch.softmax(comb, dim=-1) + self.hc_eps, self.sinkhorn_iters, self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams.float()).sum(dim=2).to(streams.dtype)
        return post, comb, collapsed


def expand(post: Tensor, comb: Tensor, output: Tensor, streams: Tensor) -> Tensor:
    """X' = post (x) y + comb^T X: the sum runs over comb's first index. float32 post and comb times the
    widened output and streams, rounded once to the streams' dtype (deepseek_v4_mhc.py:602-606)."""
    mixed = post.float().unsqueeze(-1) * output.float().unsqueeze(-2) + torch.matmul(
        comb.float().transpose(-1, -2), streams.float()
    )
    return mixed.to(streams.dtype)


class HyperHead(MegatronModule):
    """The final contraction of the streams to one (no Sinkhorn, no post)."""

    def __init__(self, config: TransformerConfig, hc_mult: int, hc_eps: float) -> None:
        super().__init__(config)
        self.hc_eps, self.norm_eps = hc_eps, config.layernorm_epsilon
        self.fn = torch.nn.Parameter(torch.zeros(hc_mult, hc_mult * config.hidden_size, dtype=torch.float32))
        self.base = torch.nn.Parameter(torch.zeros(hc_mult, dtype=torch.float32))
        self.scale = torch.nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, streams: Tensor) -> Tensor:
        flat = unweighted_rms_norm(streams.flatten(2).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn.float())
        pre = torch.sigmoid(mixes * self.scale.float() + self.base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams.float()).sum(dim=2).to(streams.dtype)
