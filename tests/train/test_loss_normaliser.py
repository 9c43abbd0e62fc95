"""The engine's loss normalisation: aggregate() per micro-batch, turned back into sums and divided by the
global normaliser, equals aggregate() over the whole mini-batch (what makes updates world-size invariant)."""

from __future__ import annotations

import pytest
import torch

from dsv4rl.algo.grpo import aggregate
from dsv4rl.train.fsdp_engine import _global_terms, _sum_factor


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_pieces_add_up_to_the_whole(mode):
    g = torch.Generator().manual_seed(0)
    values = torch.randn(7, 9, generator=g, dtype=torch.float64)
    mask = (torch.rand(7, 9, generator=g) > 0.4).double()
    mask[3] = 0  # a sequence without response tokens
    max_len = 9
    whole = aggregate(values, mask, mode)
    if mode == "seq_mean_token_sum":
        whole = aggregate(values, mask, mode, max_len=max_len)
    total, terms = 0.0, 0.0
    for rows in (slice(0, 3), slice(3, 5), slice(5, 7)):  # micro-batches / ranks
        v, m = values[rows], mask[rows]
        cols = int(m.any(0).nonzero().max()) + 1 if m.any() else 1  # trimmed like TrainBatch.trimmed
        v, m = v[:, :cols], m[:, :cols]
        total += float(aggregate(v, m, mode) * _sum_factor(m, mode))
        terms += float(_global_terms(m, mode, max_len))
    assert total / terms == pytest.approx(float(whole), rel=1e-12)
