"""The Megatron engine's attention memory, per layer type and attention form: what the plan charges.

A DeepSeek-V4 query sees its sliding window (128 keys), plus on CSA layers the indexer's top-k of the
S/4 compressed entries and on HCA layers all S/128 of them, plus a sink. The two forms of
`train/megatron/attention.py` cost:

- dense: [h, S, S + T] scores, about `DENSE_SCORE_COPIES` of them alive at the peak of a layer's backward
  (logits, the sink-extended softmax, its gradient), plus the float32 biases ([S, S] window mask, on
  compressed layers [S, S + T] and [S, T] twice): quadratic in S;
- sparse (query chunks of C, each rebuilt in backward): a per-token part (the layer's projections, norms
  and RoPE outputs and their gradients, the compressor's projections, the CSA selection as int64 indices
  and a bool mask) and one chunk's work: the gathered window and top-k keys with their gradients, and the
  [h, C, window + k] scores.

The per-token counts below are the module's own tensors at a layer's peak, fitted at tiny dimensions by
`bench/attention_memory.py` (torch's allocator events) and checked there against varied heads, head
size and hidden size; tests/estimate/test_attention.py holds the formula to the measurement.

DeepSeek-V4.1's ratio-1 and ratio-2 layers (`c1`, `c2`) are costed as CSA layers whose indexer picks its
top-k from S/1 or S/2 compressed entries, each with a compressor of its own (`c2`: kv and gate, as CSA's).
No trainer builds them yet, so nothing measured them: in V4.1 only the KV-source layers compress and the
others reuse their latents, so charging every layer a compressor errs on the high side.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from dsv4rl.config.choices import AttentionImpl

# per token, in values (model dtype): q, its norm and RoPE, the output and its inverse RoPE (h x d), the
# residual input and output projections (D), the shared KV head (d); gradients included at the peak
PER_TOKEN_HEADS, PER_TOKEN_HIDDEN, PER_TOKEN_KV = 4.0, 3.0, 6.0
COMPRESSOR_COPIES = 2.0  # the compressor's kv and gate projections (2 x width) kept for backward
INDEX_BYTES = 9  # a CSA selection slot: an int64 index and a bool
GATHER_COPIES = 2.0  # a chunk's gathered keys and their gradient ([C, window + k, d])
CHUNK_SCORE_COPIES = 4.0  # a chunk's logits, masked logits, softmax and its gradient ([h, C, window + k])
DENSE_SCORE_COPIES = 2.8  # the dense form's [h, S, K] tensors alive at the peak of backward


class LayerType(StrEnum):
    sliding = "sliding"
    csa = "csa"
    hca = "hca"
    c1 = "c1"  # DeepSeek-V4.1, compress ratio 1: one latent per token, top-k by the indexer
    c2 = "c2"  # DeepSeek-V4.1, compress ratio 2: one latent per token pair, top-k by the indexer


RATIO_TYPES = {0: LayerType.sliding, 4: LayerType.csa, 128: LayerType.hca, 1: LayerType.c1, 2: LayerType.c2}
INDEXED = (LayerType.csa, LayerType.c1, LayerType.c2)  # a query sees the indexer's top-k of the entries


@dataclass(frozen=True)
class AttentionShape:
    """The attention geometry of a DeepSeek-V4 model (the release's config.json keys in brackets)."""

    hidden: int  # [dim]
    heads: int  # [n_heads]
    head_dim: int  # [head_dim]
    q_lora_rank: int = 1024
    o_lora_rank: int = 1024
    o_groups: int = 8
    window: int = 128  # [window_size]
    csa_ratio: int = 4  # [compress_ratios: 4]
    hca_ratio: int = 128  # [compress_ratios: 128]
    index_heads: int = 64  # [index_n_heads]
    index_head_dim: int = 128  # [index_head_dim]
    index_topk: int = 512  # [index_topk]

    def entries(self, layer_type: LayerType, seq_len: int) -> int:
        """Compressed entries of a sequence (0 on sliding layers)."""
        ratio = {LayerType.sliding: 0, LayerType.csa: self.csa_ratio, LayerType.hca: self.hca_ratio,
                 LayerType.c1: 1, LayerType.c2: 2}[layer_type]  # fmt: skip
        return seq_len // ratio if ratio else 0

    def entries_seen(self, layer_type: LayerType, seq_len: int) -> int:
        """The most entries one query attends to: the indexer's top-k of the visible ones, HCA all visible."""
        entries = self.entries(layer_type, seq_len)
        return min(self.index_topk, entries) if layer_type in INDEXED else entries


def release_layer_types(layers: int) -> list[LayerType]:
    """DeepSeek-V4's layer pattern (compress_ratios [0, 0, 4, 128, 4, 128, ..., 4]): two sliding layers,
    then CSA and HCA alternating (Flash: 2 sliding, 21 CSA, 20 HCA of 43)."""
    head = [LayerType.sliding] * min(2, layers)
    return head + [LayerType.csa if i % 2 == 0 else LayerType.hca for i in range(layers - len(head))]


def layer_types(compress_ratios: tuple[int, ...] | None, layers: int) -> list[LayerType]:
    """Each backbone layer's type from its compress ratio; DeepSeek-V4's release pattern without ratios."""
    if compress_ratios is None:
        return release_layer_types(layers)
    unknown = sorted(set(compress_ratios) - set(RATIO_TYPES))
    if unknown or len(compress_ratios) != layers:
        raise ValueError(
            f"model.compress_ratios must give each of the {layers} layers one of {sorted(RATIO_TYPES)}; "
            f"got {len(compress_ratios)} entries" + (f" with {unknown}" if unknown else "")
        )
    return [RATIO_TYPES[ratio] for ratio in compress_ratios]


def per_token_bytes(shape: AttentionShape, layer_type: LayerType, value_bytes: float, tp: int = 1) -> float:
    """What a layer keeps for backward per token outside the scores (heads split over TP)."""
    heads = shape.heads / tp
    values = PER_TOKEN_HEADS * heads * shape.head_dim + PER_TOKEN_HIDDEN * shape.hidden
    values += PER_TOKEN_KV * shape.head_dim
    if layer_type != LayerType.sliding:
        width = 2 * shape.head_dim if layer_type in (LayerType.csa, LayerType.c2) else shape.head_dim
        values += COMPRESSOR_COPIES * width
    extra = INDEX_BYTES * shape.index_topk if layer_type in INDEXED else 0
    return value_bytes * values + extra


def dense_score_bytes_per_token(
    shape: AttentionShape, layer_type: LayerType, seq_len: int, tp: int = 1
) -> float:
    """The dense form's scores and biases per token (float32 biases; scores in float32 as `attend`)."""
    entries = shape.entries(layer_type, seq_len)
    keys = seq_len + entries
    scores = DENSE_SCORE_COPIES * shape.heads / tp * keys * 4
    bias = seq_len if layer_type == LayerType.sliding else 2 * seq_len + 3 * entries
    return scores + 4 * bias


def sparse_chunk_bytes(
    shape: AttentionShape, layer_type: LayerType, seq_len: int, query_chunk: int, tp: int = 1
) -> float:
    """One chunk's work, alive while it runs (float32: the core computes in float32)."""
    chunk = min(query_chunk, seq_len)
    seen = shape.entries_seen(layer_type, seq_len)
    gathered = shape.window + (seen if layer_type in INDEXED else 0)
    keys = GATHER_COPIES * chunk * gathered * shape.head_dim * 4
    scores = CHUNK_SCORE_COPIES * shape.heads / tp * chunk * (shape.window + seen + 1) * 4
    return keys + scores


def layer_peak_bytes(
    shape: AttentionShape,
    layer_type: LayerType | str,
    seq_len: int,
    attention: AttentionImpl | str,
    query_chunk: int,
    value_bytes: float,
    tp: int = 1,
) -> float:
    """Peak bytes of one attention layer's forward and backward on one sequence of `seq_len` tokens."""
    layer_type = LayerType(layer_type)
    kept = per_token_bytes(shape, layer_type, value_bytes, tp) * seq_len
    if AttentionImpl(attention) == AttentionImpl.dense:
        return kept + dense_score_bytes_per_token(shape, layer_type, seq_len, tp) * seq_len
    return kept + sparse_chunk_bytes(shape, layer_type, seq_len, query_chunk, tp)
