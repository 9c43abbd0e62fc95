"""The sparse attention core against the dense reference (`attention.attend`), forward and gradients, for
the three layer types; the chunked indexer selection against the whole-sequence one."""

from __future__ import annotations

import pytest
import torch

from dsv4rl.train.megatron.attention import attend, sliding_window_bias
from dsv4rl.train.megatron.compressor import visible_entries
from dsv4rl.train.megatron.sparse_attention import (
    EntrySelection,
    chunked_topk,
    selection_bias,
    sparse_attend,
)

BATCH, SEQ, HEADS, DIM, WINDOW, RATIO, TOPK = 2, 37, 3, 8, 5, 4, 3


def _inputs(seed: int = 0, entries: int = SEQ // RATIO):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, SEQ, HEADS, DIM, generator=generator, dtype=torch.float64).float()
    keys = torch.randn(BATCH, SEQ, DIM, generator=generator).float()
    table = torch.randn(BATCH, entries, DIM, generator=generator).float()
    sinks = torch.randn(HEADS, generator=generator).float()
    scores = torch.randn(BATCH, SEQ, entries, generator=generator)
    return q, keys, table, sinks, scores


def _dense(q, keys, sinks, entries=None, entry_bias=None):
    bias = sliding_window_bias(SEQ, WINDOW, torch.float32, q.device).expand(BATCH, SEQ, SEQ)
    if entries is not None:
        keys = torch.cat([keys, entries], dim=1)
        bias = torch.cat([bias, entry_bias], dim=-1)
    return attend(q, keys, bias, sinks, DIM**-0.5)


def _checkpoint(function, *args):
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


def _grads(output, *tensors):
    weights = torch.linspace(-1, 1, output.numel()).view_as(output)
    return torch.autograd.grad((output * weights).sum(), tensors)


@pytest.mark.parametrize("chunk", [1, 8, 64])
@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
@pytest.mark.parametrize("recompute", [False, True])
def test_sparse_matches_dense_forward_and_gradients(kind, chunk, recompute):
    q, keys, table, sinks, scores = _inputs()
    leaves = [t.requires_grad_() for t in (q, keys, table, sinks)]
    entries = entry_bias = selection = None
    if kind == "csa":
        selection = chunked_topk(lambda a, b: scores[:, a:b], SEQ, table.shape[1], RATIO, TOPK, chunk=7)
        entries, entry_bias = table, selection_bias(selection, SEQ, table.shape[1], q.device)
    elif kind == "hca":
        selection = EntrySelection(None, None, RATIO)
        visible = visible_entries(SEQ, table.shape[1], RATIO, q.device)
        entries = table
        entry_bias = (
            torch.zeros(SEQ, table.shape[1]).masked_fill(~visible, float("-inf")).expand(BATCH, -1, -1)
        )
    dense = _dense(q, keys, sinks, entries, entry_bias)
    sparse = sparse_attend(
        q,
        keys,
        WINDOW,
        sinks,
        DIM**-0.5,
        entries=entries,
        selection=selection,
        query_chunk=chunk,
        checkpoint=_checkpoint if recompute else None,
    )
    torch.testing.assert_close(sparse, dense, rtol=0, atol=1e-6)
    used = leaves if kind != "sliding" else leaves[:2] + leaves[3:]
    for got, want in zip(_grads(sparse, *used), _grads(dense, *used), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_chunked_selection_equals_the_whole_sequence_topk():
    *_, scores = _inputs(seed=3, entries=9)
    visible = visible_entries(SEQ, 9, RATIO, scores.device)
    whole = scores.masked_fill(~visible, float("-inf")).topk(TOPK, dim=-1).indices
    for chunk in (1, 5, SEQ):
        selection = chunked_topk(lambda a, b: scores[:, a:b], SEQ, 9, RATIO, TOPK, chunk)
        assert torch.equal(selection.indices, whole)
        assert torch.equal(selection.valid, whole < ((torch.arange(SEQ) + 1) // RATIO).view(1, -1, 1))


def test_early_queries_with_no_visible_entry_attend_to_their_window_only():
    q, keys, table, sinks, scores = _inputs()
    selection = chunked_topk(lambda a, b: scores[:, a:b], SEQ, table.shape[1], RATIO, TOPK, chunk=4)
    with_entries = sparse_attend(q, keys, WINDOW, sinks, DIM**-0.5, entries=table, selection=selection)
    alone = sparse_attend(q, keys, WINDOW, sinks, DIM**-0.5)
    first_visible = RATIO - 1  # query t sees entry 0 once (t + 1) // ratio >= 1
    # The masked entries add exact zeros, but with them the softmax and the weighted sum reduce over more
    # terms, in another order: float32 re-association moves a result by a few ulps of the sum (6e-8 seen,
    # output values of order 1). An entry leaking into an early query would move it by that entry's
    # weight, four orders of magnitude more, as the later queries show.
    torch.testing.assert_close(with_entries[:, :first_visible], alone[:, :first_visible], rtol=0, atol=1e-6)
    assert (with_entries[:, first_visible:] - alone[:, first_visible:]).abs().max() > 1e-2
