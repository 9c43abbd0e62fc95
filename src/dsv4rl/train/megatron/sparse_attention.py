"""DeepSeek-V4's attention over only the keys it attends to, in query chunks.

A query t attends to its sliding window (keys t - window < s <= t), plus, on CSA layers, the indexer's
top-k of the visible compressed entries and, on HCA layers, every visible entry (w < (t + 1) // ratio),
and a per-head sink in the softmax denominator. The dense form (`attention.attend`) builds `[S, S + T]`
biases and a `[B, h, S, S + T]` softmax; here each chunk of queries gathers its window (a strided view of
the keys, no copy) and its entries, so memory and work grow with S x (window + entries seen), as in
SGLang's sparse kernels, which also take the window and the top-k as index lists
(sglang/srt/layers/attention/dsv4/ builds them per query; the released FlashMLA sparse kernel reads
`indices` [S, h_kv, topk]).

The arithmetic is the dense form's: float32 logits, sink and softmax, one rounding of the output; only
the order of the final sum differs (window part plus entry part), a float32 rounding apart.

In training every chunk is recomputed in backward (`checkpoint`): autograd would otherwise keep each
chunk's gathered keys ([C, window + k, d]) and scores for backward, which summed over the chunks is far
more than the dense form's scores. What stays is linear in S (q, keys, entries, the selection, the
output); one chunk's gathers and scores live at a time, forward or backward. FlashAttention-style kernels
make the same trade (scores rebuilt in backward), so this holds whatever the recompute setting.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

DEFAULT_QUERY_CHUNK = 256


@dataclass(frozen=True)
class EntrySelection:
    """Which compressed entries each query sees. `indices` [B, S, k] into the entries with `valid`
    [B, S, k] (CSA: the indexer's top-k; a query with fewer than k visible entries has invalid slots);
    or `indices` None: every visible entry (HCA), by the compression ratio."""

    indices: Tensor | None
    valid: Tensor | None
    ratio: int


def window_valid(start: int, stop: int, window: int, device: torch.device) -> Tensor:
    """[C, window] bool for queries start..stop-1: slot w holds key t - window + 1 + w, valid if >= 0."""
    queries = torch.arange(start, stop, device=device).view(-1, 1)
    return queries - (window - 1) + torch.arange(window, device=device).view(1, -1) >= 0


def visible_count(start: int, stop: int, ratio: int, device: torch.device) -> Tensor:
    """[C]: how many entries queries start..stop-1 see (entry w is visible to t once w < (t + 1) // ratio)."""
    return (torch.arange(start, stop, device=device) + 1) // ratio


def chunk_bounds(seq_len: int, chunk: int) -> list[tuple[int, int]]:
    return [(start, min(start + chunk, seq_len)) for start in range(0, seq_len, max(1, chunk))]


def _attend_chunk(
    q: Tensor,
    window_ok: Tensor,
    entries: Tensor | None,
    entry_index: Tensor | None,
    entry_ok: Tensor | None,
    sinks: Tensor,
    scale: float,
    window: int,
    *key_pieces: Tensor,
) -> Tensor:
    """q [B, C, h, d]; the keys of its windows as consecutive pieces of the front-padded keys (C + window
    - 1 of them from the first on) with window_ok [C, W]; entries [B, T, d] seen through entry_index
    [B, C, k] with entry_ok [B, C, k] (CSA), or all of them with entry_ok [C, T] (HCA) -> [B, C, h, d] in
    q's dtype. Gathers happen here, so a checkpoint keeps indices and views, never gathered keys."""
    chunk = q.shape[1]
    block = torch.cat(key_pieces, dim=1) if len(key_pieces) > 1 else key_pieces[0]
    window_keys = (
        block[:, : chunk + window - 1].float().unfold(1, window, 1).transpose(-1, -2)
    )  # [B, C, W, d]
    q32 = q.float()
    logits = torch.einsum("bchd,bcwd->bhcw", q32, window_keys) * scale
    logits = logits.masked_fill(~window_ok, float("-inf"))
    parts = [logits]
    entry_keys = None
    if entries is not None:
        entry_keys = entries.float()
        if entry_index is not None:
            batch, _, k = entry_index.shape
            gather_at = entry_index.reshape(batch, -1, 1).expand(-1, -1, entries.shape[-1])
            entry_keys = entry_keys.gather(1, gather_at).view(batch, chunk, k, -1)  # [B, C, k, d]
        pattern = "bchd,bckd->bhck" if entry_keys.dim() == 4 else "bchd,bkd->bhck"
        entry_logits = torch.einsum(pattern, q32, entry_keys) * scale
        mask = entry_ok.unsqueeze(1) if entry_ok.dim() == 3 else entry_ok
        parts.append(entry_logits.masked_fill(~mask, float("-inf")))
    parts.append(sinks.float().view(1, -1, 1, 1).expand(*logits.shape[:-1], 1))
    combined = torch.cat(parts, dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)
    out = torch.einsum("bhcw,bcwd->bchd", probs[..., :window], window_keys)
    if entry_keys is not None:
        pattern = "bhck,bckd->bchd" if entry_keys.dim() == 4 else "bhck,bkd->bchd"
        out = out + torch.einsum(pattern, probs[..., window:-1], entry_keys)
    return out.to(q.dtype)


def sparse_attend(
    q: Tensor,
    keys: Tensor,
    window: int,
    sinks: Tensor,
    scale: float,
    entries: Tensor | None = None,
    selection: EntrySelection | None = None,
    query_chunk: int = DEFAULT_QUERY_CHUNK,
    checkpoint: Callable[..., Tensor] | None = None,
) -> Tensor:
    """q [B, S, h, d], keys [B, S, d] (keys are also the values), entries [B, T, d] with `selection`;
    -> [B, S, h, d] in q's dtype. `checkpoint(fn, *args)` wraps each chunk when autograd records (the
    chunk is rebuilt in backward); None keeps every chunk's intermediates (tests, inference).

    q and the keys are cut with `split`, whose backward joins the chunks' gradients once; slicing per
    chunk would build a zero gradient of the whole tensor for every chunk (quadratic in S)."""
    seq = q.shape[1]
    chunk = max(1, query_chunk)
    q_pieces = q.split(chunk, dim=1)
    key_pieces = F.pad(keys, (0, 0, window - 1, 0)).split(chunk, dim=1)  # piece i starts at query i*chunk
    reach = -(-(window - 1) // chunk)  # the further pieces a chunk's windows reach into
    outputs = []
    for index, (start, stop) in enumerate(chunk_bounds(seq, chunk)):
        window_ok = window_valid(start, stop, window, q.device)
        chunk_entries = entry_index = entry_ok = None
        if entries is not None and selection is not None and entries.shape[1] > 0:
            if selection.indices is not None:
                chunk_entries = entries
                entry_index = selection.indices[:, start:stop]  # [B, C, k]
                entry_ok = selection.valid[:, start:stop]
            elif stop // selection.ratio > 0:
                chunk_entries = entries[:, : min(stop // selection.ratio, entries.shape[1])]
                count = visible_count(start, stop, selection.ratio, q.device)
                entry_ok = torch.arange(chunk_entries.shape[1], device=q.device).view(1, -1) < count.view(
                    -1, 1
                )
        args = (q_pieces[index], window_ok, chunk_entries, entry_index, entry_ok, sinks)
        pieces = key_pieces[index : index + 1 + reach]
        if checkpoint is not None and torch.is_grad_enabled():
            outputs.append(checkpoint(_ChunkAttention(scale, window), *args, *pieces))
        else:
            outputs.append(_attend_chunk(*args, scale, window, *pieces))
    return torch.cat(outputs, dim=1)


class _ChunkAttention:
    """`_attend_chunk` with the scale and window bound, for checkpoint functions that take tensors only."""

    def __init__(self, scale: float, window: int) -> None:
        self.scale, self.window = scale, window

    def __call__(self, q: Tensor, window_ok: Tensor, *rest: Tensor | None) -> Tensor:
        entries, entry_index, entry_ok, sinks, *pieces = rest
        return _attend_chunk(
            q, window_ok, entries, entry_index, entry_ok, sinks, self.scale, self.window, *pieces
        )


def chunked_topk(
    scores_of: Callable[[int, int], Tensor], seq_len: int, entries: int, ratio: int, topk: int, chunk: int
) -> EntrySelection:
    """The indexer's selection computed `chunk` queries at a time: `scores_of(start, stop)` gives the
    [B, C, T] scores of those queries; the top-k of the visible ones per query, with `valid` marking
    slots past a query's visible count (as the dense form's `selected & visible`). Memory: one chunk's
    scores, O(chunk x T), instead of O(S x T)."""
    k = min(topk, entries)
    indices, valid = [], []
    for start, stop in chunk_bounds(seq_len, chunk):
        scores = scores_of(start, stop)
        count = visible_count(start, stop, ratio, scores.device)
        visible = torch.arange(entries, device=scores.device).view(1, -1) < count.view(-1, 1)
        chosen = scores.masked_fill(~visible, float("-inf")).topk(k, dim=-1).indices
        indices.append(chosen)
        valid.append(chosen < count.view(1, -1, 1))
    return EntrySelection(torch.cat(indices, dim=1), torch.cat(valid, dim=1), ratio)


def selection_bias(selection: EntrySelection, seq_len: int, entries: int, device: torch.device) -> Tensor:
    """The dense form of a top-k selection: [B, S, T] additive bias, 0 where selected, -inf elsewhere."""
    batch = selection.indices.shape[0]
    bias = torch.full((batch, seq_len, entries), float("-inf"), device=device)
    if entries == 0:
        return bias
    chosen = torch.zeros(batch, seq_len, entries, dtype=torch.bool, device=device)
    chosen.scatter_(-1, selection.indices, selection.valid)
    return bias.masked_fill(chosen, 0.0)
