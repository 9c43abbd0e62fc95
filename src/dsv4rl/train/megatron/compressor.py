"""The KV compressors of DeepSeek-V4's compressed attention layers, and the CSA lightning indexer.

HCA (ratio 128): each closed window of `ratio` tokens becomes one KV entry, a channel-wise softmax
(gate + absolute-position bias) over the window. CSA (ratio 4): windows overlap, each entry mixes the
first halves of the previous window's tokens with the second halves of its own (2 x ratio slots). An
entry w is visible to query t once w < (t + 1) // ratio; CSA queries see only the indexer's top-k of
the visible entries. This is the training (whole-sequence) form; incremental decoding is the
inference engines' business.

The weights are small and replicated on every tensor-parallel rank (the attention heads they feed
are split); the attention sums the heads' gradients on their output (`shared_by_all_heads`).

In bf16 a compressor computes as SGLang's does, in float32 from the projections to RoPE, rounding once
on the entries it hands on: the projections' outputs are float32 (`linear_bf16_fp32`,
sglang/srt/layers/attention/dsv4/compressor.py:160-166, the position bias `ape` float32 at :63-65),
the gated pooling is a float32 softmax and a float32 weighted sum written to a float32 output
(sglang/srt/layers/attention/dsv4/compressor_v2.py:112-121;
sglang/kernels/jit/csrc/deepseek_v4/c4_v2.cuh:182-214), then norm and RoPE run on that float32 entry
before the store (compressor_v2.py:129-131). transformers rounds the projections, the softmax weights,
the products and the sum to bf16 (transformers/models/deepseek_v4/modeling_deepseek_v4.py:428, 685).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

from dsv4rl.model.replay import ReplayCounts
from dsv4rl.train.megatron.replay import replayed_selection
from dsv4rl.train.megatron.rope import RotaryTables, apply_interleaved_rope, rotate
from dsv4rl.train.megatron.sparse_attention import EntrySelection, chunked_topk, selection_bias


class RMSNorm(torch.nn.Module):
    """RMSNorm in float32 with a float32 weight, cast back once (the released model's rule)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x).to(dtype)


def linear(in_features: int, out_features: int, dtype: torch.dtype) -> torch.nn.Linear:
    return torch.nn.Linear(in_features, out_features, bias=False, dtype=dtype)


def compress_windows(
    kv: Tensor, gate: Tensor, ape: Tensor, ratio: int, head_dim: int, overlap: bool
) -> Tensor:
    """[B, S, C] projections -> [B, S // ratio, head_dim] float32 entries (before norm and RoPE): the
    softmax over each window's slots and the weighted sum in float32 (c4_v2.cuh:182-214)."""
    batch = kv.shape[0]
    usable = (kv.shape[1] // ratio) * ratio
    windows = usable // ratio
    if windows == 0:
        return kv.new_zeros(batch, 0, head_dim, dtype=torch.float32)
    kv = kv[:, :usable].float().view(batch, windows, ratio, -1)
    gate = gate[:, :usable].float().view(batch, windows, ratio, -1) + ape.float()
    if overlap:
        slots_kv = kv.new_zeros(batch, windows, 2 * ratio, head_dim)
        slots_gate = gate.new_full((batch, windows, 2 * ratio, head_dim), float("-inf"))
        slots_kv[:, :, ratio:] = kv[..., head_dim:]
        slots_gate[:, :, ratio:] = gate[..., head_dim:]
        slots_kv[:, 1:, :ratio] = kv[:, :-1, :, :head_dim]
        slots_gate[:, 1:, :ratio] = gate[:, :-1, :, :head_dim]
        kv, gate = slots_kv, slots_gate
    return (kv * gate.softmax(dim=2)).sum(dim=2)


def visible_entries(seq_len: int, entries: int, ratio: int, device: torch.device) -> Tensor:
    """[S, T] bool: entry w is causally visible to query t (w < (t + 1) // ratio)."""
    threshold = (torch.arange(seq_len, device=device) + 1) // ratio
    return torch.arange(entries, device=device).view(1, -1) < threshold.view(-1, 1)


class Compressor(MegatronModule):
    """One compressor: `wkv`, `wgate`, `ape`, `norm`, RoPE at the window's first position."""

    def __init__(
        self, config: TransformerConfig, ratio: int, head_dim: int, rope_dim: int, overlap: bool
    ) -> None:
        super().__init__(config)
        self.ratio, self.head_dim, self.rope_dim, self.overlap = ratio, head_dim, rope_dim, overlap
        width = 2 * head_dim if overlap else head_dim
        self.linear_wkv = linear(config.hidden_size, width, config.params_dtype)
        self.linear_wgate = linear(config.hidden_size, width, config.params_dtype)
        self.ape = torch.nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32))
        self.norm = RMSNorm(head_dim, config.layernorm_epsilon)

    def forward(self, hidden: Tensor, rope: RotaryTables) -> Tensor:
        """hidden [B, S, D] -> entries [B, S // ratio, head_dim] in hidden's dtype, RoPE'd (compress
        tables); float32 inside, rounded once at the end."""
        wide = hidden.float()  # bf16 x bf16 products, float32 sums and output, as linear_bf16_fp32
        entries = compress_windows(
            F.linear(wide, self.linear_wkv.weight.float()),
            F.linear(wide, self.linear_wgate.weight.float()),
            self.ape,
            self.ratio,
            self.head_dim,
            self.overlap,
        )
        entries = self.norm(entries)  # float32 in, float32 out (the weight is float32)
        positions = torch.arange(entries.shape[1], device=hidden.device) * self.ratio
        cos, sin = rope.at(positions)
        return rotate(entries.unsqueeze(2), cos, sin).squeeze(2).to(hidden.dtype)


class Indexer(MegatronModule):
    """The lightning indexer: score(t, s) = sum_h w_th ReLU(q_th . k_s); keep the top-k visible entries.

    Top-k selection has no gradient, so neither have these weights (as in transformers).
    """

    def __init__(
        self,
        config: TransformerConfig,
        q_lora_rank: int,
        heads: int,
        head_dim: int,
        topk: int,
        ratio: int,
        rope_dim: int,
    ) -> None:
        super().__init__(config)
        self.heads, self.head_dim, self.topk, self.ratio = heads, head_dim, topk, ratio
        self.compressor = Compressor(config, ratio, head_dim, rope_dim, overlap=True)
        self.linear_wq_b = linear(q_lora_rank, heads * head_dim, config.params_dtype)
        self.linear_weights_proj = linear(config.hidden_size, heads, config.params_dtype)
        # algo.indexer_replay: the rollout's top-k [B, S, K] (dsv4rl.train.megatron.replay), set by the block
        self.replay: Tensor | None = None
        self.replay_counts: ReplayCounts | None = None

    def select(
        self, hidden: Tensor, q_compressed: Tensor, rope: RotaryTables, query_chunk: int
    ) -> EntrySelection:
        """The top-k visible CSA entries of each query, scored `query_chunk` queries at a time: the
        [B, C, H, T] float32 scores of one chunk live at once, not the [B, S, H, T] of the sequence."""
        batch, seq, _ = hidden.shape
        keys = self.compressor(hidden, rope).float()
        q = self.linear_wq_b(q_compressed).view(batch, seq, self.heads, self.head_dim)
        cos, sin = rope.at(torch.arange(seq, device=hidden.device))
        q = apply_interleaved_rope(q, cos, sin)
        weights = self.linear_weights_proj(hidden).float() * self.heads**-0.5

        def scores_of(start: int, stop: int) -> Tensor:
            scores = torch.matmul(
                q[:, start:stop].float(), keys.transpose(-1, -2).unsqueeze(1)
            )  # [B, C, H, T]
            scores = F.relu(scores) * self.head_dim**-0.5
            return (scores * weights[:, start:stop].unsqueeze(-1)).sum(dim=2)  # [B, C, T]

        selection = chunked_topk(scores_of, seq, keys.shape[1], self.ratio, self.topk, query_chunk)
        if self.replay is None:
            return selection
        return replayed_selection(selection, self.replay[:, :seq], keys.shape[1], self.replay_counts)

    def forward(
        self, hidden: Tensor, q_compressed: Tensor, rope: RotaryTables, query_chunk: int = 1024
    ) -> Tensor:
        """[B, S, T] additive bias over the CSA entries: 0 for the selected, -inf elsewhere (the dense
        attention's form of `select`)."""
        selection = self.select(hidden, q_compressed, rope, query_chunk)
        entries = hidden.shape[1] // self.ratio
        return selection_bias(selection, hidden.shape[1], entries, hidden.device).to(hidden.dtype)
