"""The GRPO/DAPO training loss of one micro-batch, and its normalisation over the global mini-batch.

Every trainer backend (fsdp, megatron) runs only the forward and the backward, through the one update
loop of `dsv4rl.train.update`; what is minimised is decided here, once. A mini-batch is split over ranks
and micro-batches, but the loss must be the one of the whole mini-batch, so the update does not depend on
the world size or the micro-batch size:

- `micro_batch_loss` returns the micro-batch's loss as an additive *sum* (its `aggregate` times
  `sum_factor`), with the policy-gradient term (PPO clip, DAPO clip-higher, TIS weights), the KL
  penalty against a reference model and the entropy bonus;
- `normaliser_share` is this rank's share of the mini-batch's normaliser; the update loop all-reduces it
  and scales each backward by `gradient_scale` (data-parallel gradient averaging undone).

Sum over micro-batches and ranks of `loss_sum` / the all-reduced normaliser equals `aggregate` over the
whole mini-batch (tests/algo/test_loss.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from dsv4rl.algo.grpo import aggregate, entropy_from_logits, kl_penalty, loss_aggregation, policy_loss
from dsv4rl.algo.mismatch import correction_weights
from dsv4rl.algo.staleness import tis_on
from dsv4rl.config.choices import KLEstimator, LossAggregation
from dsv4rl.config.schema import AlgoConfig

# What turns `aggregate(values, mask, mode)` of one micro-batch back into an additive sum over its
# sequences or tokens (mirrors `dsv4rl.algo.grpo.AGGREGATE`).
SUM_FACTOR: dict[LossAggregation, Callable[[Tensor], Tensor]] = {
    LossAggregation.token_mean: lambda mask: mask.sum(),
    LossAggregation.seq_mean_token_mean: lambda mask: (mask.sum(dim=-1) > 0).sum().to(mask.dtype),
    # aggregate divides by B and by L (the micro-batch's length)
    LossAggregation.seq_mean_token_sum: lambda mask: torch.tensor(
        float(mask.shape[0] * mask.shape[1]), device=mask.device
    ),
}


def sum_factor(mask: Tensor, mode: LossAggregation | str) -> Tensor:
    return SUM_FACTOR[loss_aggregation(mode)](mask)


def normaliser_share(mask: Tensor, mode: LossAggregation | str, max_len: int) -> Tensor:
    """This rank's share of the mini-batch normaliser (the caller all-reduces it over ranks)."""
    if loss_aggregation(mode) == LossAggregation.seq_mean_token_sum:  # Dr.GRPO: the response cap per sequence
        return torch.tensor(float(mask.shape[0] * max_len), device=mask.device)
    return sum_factor(mask, mode)


def gradient_scale(normaliser: float, world: int) -> float:
    """The factor of each micro-batch's `loss_sum` before backward: divided by the global normaliser (no
    response token anywhere: loss 0, as `aggregate` gives), times the world size that data-parallel
    gradient averaging divides by."""
    return world / max(normaliser, 1.0)


@dataclass
class MicroBatchLoss:
    """One micro-batch: the differentiable loss sum, and detached sums over its response tokens."""

    loss_sum: Tensor
    entropy_sum: Tensor
    clipped_tokens: Tensor  # tokens where PPO's clip cut the gradient
    ref_kl_sum: Tensor | None  # k3 estimate against the reference model (None without one)


def micro_batch_loss(
    logprobs: Tensor,
    logits: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    algo: AlgoConfig,
    temperature: float,
    ref_logprobs: Tensor | None = None,
    tis_weights: Tensor | None = None,
) -> MicroBatchLoss:
    """The loss of one micro-batch as a sum (see the module doc). `logits` [B, T, V] are the forward's,
    `logprobs` [B, T-1] the response-token log-probs computed from them at `temperature`."""
    mode = loss_aggregation(algo.loss_aggregation)
    local = sum_factor(loss_mask, mode)
    pg, pg_metrics = policy_loss(
        logprobs,
        old_logprobs,
        advantages,
        loss_mask,
        algo.eps_clip_low,
        algo.eps_clip_high,
        aggregation=mode,
        tis_weights=tis_weights,
    )
    loss_sum = pg * local
    ref_kl_sum = None
    if ref_logprobs is not None:
        kl_tokens = kl_penalty(logprobs, ref_logprobs, algo.kl_estimator)
        loss_sum = loss_sum + algo.kl_coef * aggregate(kl_tokens, loss_mask, mode) * local
        with torch.no_grad():
            ref_kl_sum = (kl_penalty(logprobs, ref_logprobs, KLEstimator.k3) * loss_mask).sum()
    scaled = logits[:, :-1] / temperature if temperature > 0 else logits[:, :-1]
    if algo.entropy_coef > 0:
        entropy = entropy_from_logits(scaled)
        loss_sum = loss_sum - algo.entropy_coef * aggregate(entropy, loss_mask, mode) * local
    else:
        with torch.no_grad():
            entropy = entropy_from_logits(scaled)
    return MicroBatchLoss(
        loss_sum=loss_sum,
        entropy_sum=(entropy.detach() * loss_mask).sum(),
        clipped_tokens=float(pg_metrics.get("clipfrac", 0.0)) * loss_mask.sum(),
        ref_kl_sum=ref_kl_sum,
    )


# A train step's sums over response tokens, one float64 vector the update loop all-reduces over ranks; the
# loss terms come per micro-batch, `step_sums` gives the batch-derived ones.
LOSS, ENTROPY, KL, CLIPPED, ABS_DIFF, TOKENS, TIS_CLIPPED, MIS_MASKED = range(8)
NUM_STEP_SUMS = 8


def reuses_policy_forward(updates_per_step: int, old_logprobs_given: bool) -> bool:
    """Whether a train step can take the old-policy log-probs from its own training forward.

    With one optimizer step per rollout batch the old policy is the current one: a separate no-grad
    forward would compute exactly the log-probs the training forward computes (ratio 1), so the training
    forward's detached log-probs serve as the old ones, and TIS/MIS and the train-vs-rollout sums are
    taken per micro-batch from them. With several updates the first one changes the weights, so the old
    log-probs must come from a forward before it."""
    return updates_per_step == 1 and not old_logprobs_given


def sampled_only(rollout_logprobs: Tensor, old_logprobs: Tensor, loss_mask: Tensor) -> Tensor:
    """The rollout log-probs on the loss-bearing targets, the old policy's elsewhere.

    A target the model did not sample (a tool result or a turn token the chat template inserted, the
    prompt, padding) carries whatever the rollout left there (0.0, or anything else): with this it has
    train-vs-rollout ratio 1 and difference 0, so not even a non-finite value there (-inf * 0 is NaN)
    reaches the TIS/MIS weights, the loss or a metric."""
    return torch.where(loss_mask > 0, rollout_logprobs, old_logprobs)


def rollout_corrections(
    algo: AlgoConfig, old_logprobs: Tensor, rollout_logprobs: Tensor, loss_mask: Tensor
) -> tuple[Tensor | None, dict[str, float]]:
    """TIS/MIS weights of the train-vs-rollout mismatch as `algo.tis` / `algo.mis` ask for them."""
    return correction_weights(
        old_logprobs,
        sampled_only(rollout_logprobs, old_logprobs, loss_mask),
        loss_mask,
        tis_clip=algo.tis.clip if tis_on(algo) else None,
        mis_bounds=(algo.mis.low, algo.mis.high) if algo.mis.enabled else None,
    )


def step_sums(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    loss_mask: Tensor,
    corrections: dict[str, float],
    with_reference: bool,
) -> Tensor:
    """The batch-derived sums of a step; without a reference model KL is k3 against the rollout."""
    sums = torch.zeros(NUM_STEP_SUMS, dtype=torch.float64, device=loss_mask.device)
    rollout_logprobs = sampled_only(rollout_logprobs, old_logprobs, loss_mask)
    sums[ABS_DIFF] = ((old_logprobs - rollout_logprobs).abs() * loss_mask).sum()
    sums[TOKENS] = loss_mask.sum()
    sums[TIS_CLIPPED] = corrections["tis_clipped"]
    sums[MIS_MASKED] = corrections["mis_masked"]
    if not with_reference:
        sums[KL] = (kl_penalty(old_logprobs, rollout_logprobs, KLEstimator.k3) * loss_mask).sum()
    return sums


@dataclass
class OldPolicy:
    """Where a train step's old-policy log-probs come from (`reuses_policy_forward`): `reuse`, each
    micro-batch's own training forward (`from_training_forward`); else `logprobs` over the whole batch,
    computed before the first update, with their TIS weights. `sums`: the step's batch-derived sums,
    zeros to accumulate the micro-batches' into when `reuse`."""

    reuse: bool
    logprobs: Tensor | None
    tis_weights: Tensor | None
    sums: Tensor


def old_policy(
    algo: AlgoConfig,
    given: Tensor | None,
    rollout_logprobs: Tensor,
    loss_mask: Tensor,
    with_reference: bool,
    compute: Callable[[], Tensor],
    reuse_allowed: bool = True,
) -> OldPolicy:
    """The old policy of a step: `given` (the batch's own), the training forward's, or `compute()` (a
    no-grad pass on the micro-batches the update will use). `reuse_allowed=False` forces the pass."""
    if reuse_allowed and reuses_policy_forward(algo.updates_per_step, given is not None):
        zeros = torch.zeros(NUM_STEP_SUMS, dtype=torch.float64, device=loss_mask.device)
        return OldPolicy(True, None, None, zeros)
    old = given if given is not None else compute()
    tis, corrections = rollout_corrections(algo, old, rollout_logprobs, loss_mask)
    return OldPolicy(
        False, old, tis, step_sums(old, rollout_logprobs, loss_mask, corrections, with_reference)
    )


def from_training_forward(
    algo: AlgoConfig, logprobs: Tensor, rollout_logprobs: Tensor, loss_mask: Tensor, with_reference: bool
) -> tuple[Tensor, Tensor | None, Tensor]:
    """With `OldPolicy.reuse`: a micro-batch's old log-probs (its training forward's, detached), their TIS
    weights, and the micro-batch's share of the step sums."""
    old = logprobs.detach()
    tis, corrections = rollout_corrections(algo, old, rollout_logprobs, loss_mask)
    return old, tis, step_sums(old, rollout_logprobs, loss_mask, corrections, with_reference)


def step_metrics(
    sums: Tensor, updates: int, grad_norms: list[float], lrs: list[float], with_reference: bool
) -> dict[str, float]:
    """The metrics of a step from its all-reduced sums (per response token, per update)."""
    tokens = max(float(sums[TOKENS]), 1.0)
    kl_tokens = tokens * (updates if with_reference else 1)
    return {
        "loss": float(sums[LOSS]) / updates,
        "grad_norm": sum(grad_norms) / len(grad_norms),
        "kl": float(sums[KL]) / kl_tokens,
        "entropy": float(sums[ENTROPY]) / (tokens * updates),
        "clipfrac": float(sums[CLIPPED]) / (tokens * updates),
        "lr": lrs[-1],
        "logprob_abs_diff": float(sums[ABS_DIFF]) / tokens,
        "response_tokens": float(sums[TOKENS]),
        "tis_clip_fraction": float(sums[TIS_CLIPPED]) / tokens,
        "mis_masked_fraction": float(sums[MIS_MASKED]) / tokens,
    }
