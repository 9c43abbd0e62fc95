"""The trainer's non-finite guard: which optimizer steps are skipped, and which weights never leave.

Before each optimizer step the update loop (`dsv4rl.train.update`) asks `update_culprit` whether the
mini-batch's loss or the global gradient norm is NaN or Inf, agreed across every training rank (the loss
lives on the last pipeline stage, a NaN gradient on whichever rank's shard holds it). A non-finite step is
skipped: no optimizer call at all, so the weights, Adam's moments and its step count stay bit for bit
what they were, and the learning-rate schedule does not advance (its position is the count of optimizer
steps taken, as megatron-LM's scheduler only steps after a successful update). `train.max_nonfinite_steps`
skips in a row are tolerated; the next one stops the run with a `NonFiniteError` naming the step, the
phase and the first non-finite tensor: `loss`, or the first parameter (in the model's order, lowest rank
first) whose gradient holds a NaN or Inf.

`require_finite_weights` runs before every weight sync and every checkpoint: non-finite weights are never
pushed to the engines nor written, and the run stops naming the first such weight.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from dsv4rl.faults.nonfinite import NonFiniteError, all_finite, first_nonfinite

LOSS = "loss"


class Guarded(Protocol):
    """What the guard reads from a trainer backend: this rank's (local) weights and gradients."""

    device: torch.device

    def local_weights(self) -> Iterator[tuple[str, Tensor]]: ...

    def local_gradients(self) -> Iterator[tuple[str, Tensor]]: ...


def any_rank(flags: list[bool], device: torch.device) -> list[bool]:
    """Collective over the default group: each flag, true when it is true on any rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(flags)
    reduced = torch.tensor([float(flag) for flag in flags], device=device)
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
    return [bool(value > 0) for value in reduced.tolist()]


def first_across_ranks(found: tuple[str, str] | None) -> str | None:
    """Collective: the lowest rank's find, as `<name> (<what>, rank <r>)`, or None when no rank found one."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None if found is None else f"{found[0]} ({found[1]})"
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, found)
    for rank, item in enumerate(every):
        if item is not None:
            name, what = item
            return f"{name} ({what}, rank {rank})"
    return None


def update_culprit(backend: Guarded, loss_sum: Tensor, grad_norm: float) -> str | None:
    """Collective, before an optimizer step: None when the loss and the gradient norm are finite on every
    rank, else the first non-finite tensor: `loss`, or `the gradient of <parameter> (...)`."""
    loss_bad, norm_bad = any_rank(
        [not math.isfinite(float(loss_sum)), not math.isfinite(grad_norm)], backend.device
    )
    if loss_bad:
        return LOSS
    if not norm_bad:
        return None
    found = first_across_ranks(first_nonfinite(backend.local_gradients()))
    if found is None:  # every gradient finite, their squares' sum is not
        return f"the gradient norm ({grad_norm}: finite gradients so large that their norm overflows)"
    return f"the gradient of {found}"


def require_finite_weights(backend: Guarded, step: int | None, phase: str, consequence: str) -> None:
    """Collective: raise `NonFiniteError` (the same on every rank) when any rank holds a non-finite weight.
    `consequence` says what did not happen (`nothing was pushed to the engines`)."""
    (bad,) = any_rank([not all_finite(t for _, t in backend.local_weights())], backend.device)
    if not bad:
        return
    found = first_across_ranks(first_nonfinite(backend.local_weights()))
    raise NonFiniteError(
        step,
        phase,
        f"weight {found}",
        f"{consequence}. Non-finite weights are never pushed to the engines nor checkpointed; resume=true "
        "continues from the newest checkpoint (each was checked finite)",
    )
