"""Sinkhorn-Knopp for DeepSeek-V4's mHC mixing matrices, laid out for small matrices.

Every token's [N, N] mixing matrix (N = hc_mult = 4) is made doubly stochastic by 20 rounds that divide
by the column sums, then by the row sums (the first round only by the column sums). Written as in the
release and in transformers, each sum and each division runs along a dimension of 4 elements, and
autograd records 3 ops per normalisation and 7 more in backward. Here the rounds run on an [N, N, tokens]
copy, so every sum and division runs along the tokens, and the backward of a normalisation
z = x / (sum(x) + eps) is its closed form, grad_x = (grad_z - sum(grad_z * z)) / (sum(x) + eps).

The values are bitwise those of the plain loop on CPU (each sum adds the same four numbers in the same
order; tested), and the gradients agree to float32 rounding. Every sum and division runs along the
tokens, which makes it several times faster than the loop over [N, N] blocks (docs/performance.md).
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection

COLUMNS, ROWS = 0, 1  # the dimension a normalisation sums over, in the [N, N, tokens] layout


def _normalise(matrices: Tensor, dim: int, eps: float) -> tuple[Tensor, Tensor]:
    denominator = matrices.sum(dim=dim, keepdim=True) + eps
    return matrices / denominator, denominator


class _SinkhornRounds(torch.autograd.Function):
    """`rounds` x (rows, then columns) on [..., N, N]; saves each normalisation's output and denominator."""

    @staticmethod
    def forward(ctx, comb: Tensor, rounds: int, eps: float) -> Tensor:
        matrices = comb.movedim((-2, -1), (0, 1)).contiguous()
        saved = []
        for _ in range(rounds):
            for dim in (ROWS, COLUMNS):
                matrices, denominator = _normalise(matrices, dim, eps)
                saved += [matrices, denominator]
        ctx.save_for_backward(*saved)
        ctx.rounds = rounds
        return matrices.movedim((0, 1), (-2, -1)).contiguous()

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        grad = grad.movedim((-2, -1), (0, 1)).contiguous()
        saved = ctx.saved_tensors
        dims = (ROWS, COLUMNS) * ctx.rounds
        for index in reversed(range(len(dims))):
            output, denominator = saved[2 * index], saved[2 * index + 1]
            grad = (grad - (grad * output).sum(dim=dims[index], keepdim=True)) / denominator
        return grad.movedim((0, 1), (-2, -1)).contiguous(), None, None


def sinkhorn_rounds(comb: Tensor, rounds: int, eps: float) -> Tensor:
    """`rounds` row-then-column normalisations of `comb` [..., N, N] (float32), differentiable."""
    if rounds <= 0:
        return comb
    return _SinkhornRounds.apply(comb, rounds, eps)


def sinkhorn(comb: Tensor, iters: int, eps: float) -> Tensor:
    """`iters` column and `iters - 1` row normalisations, columns first (the release's order)."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return sinkhorn_rounds(comb, iters - 1, eps)


class FastSinkhornHyperConnection(DeepseekV4HyperConnection):
    """transformers' mHC module with its Sinkhorn rounds in `sinkhorn_rounds`: transformers' forward runs
    with one iteration (the first column normalisation), the remaining rounds run here."""

    sinkhorn_rounds_left: int

    def forward(self, hidden_streams: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        post, comb, collapsed = super().forward(hidden_streams)
        return post, sinkhorn_rounds(comb, self.sinkhorn_rounds_left, self.hc_eps), collapsed


def use_fast_sinkhorn(model: torch.nn.Module) -> int:
    """Switch every transformers mHC module of `model` to `FastSinkhornHyperConnection` (same parameters,
    same values out); returns how many. Idempotent."""
    switched = 0
    for module in model.modules():
        if type(module) is DeepseekV4HyperConnection:
            module.__class__ = FastSinkhornHyperConnection
            module.sinkhorn_rounds_left = module.hc_sinkhorn_iters - 1
            module.hc_sinkhorn_iters = 1
            switched += 1
    return switched
