"""GRPO maths: group-relative advantages, token log-probs, the clipped policy loss and KL.

The train-vs-rollout mismatch corrections (TIS, MIS) live in `dsv4rl.algo.mismatch`.

Conventions: for `input_ids [B, T]`, per-token tensors are `[B, T-1]` and
position t scores the target `input_ids[:, t+1]`; `loss_mask` is 1.0 on response tokens. Everything is
computed in float32 whatever the logits' dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from dsv4rl.config.choices import KLEstimator, LossAggregation

_MAX_LOG_RATIO = 20.0  # exp(20) ~ 5e8: bounds ratios so one wild token cannot produce inf/nan


def loss_aggregation(mode: LossAggregation | str) -> LossAggregation:
    """`mode` as the schema's enum; a plain string is accepted where it names one (tests, notebooks)."""
    try:
        return LossAggregation(mode)
    except ValueError:
        raise ValueError(
            f"unknown loss aggregation {str(mode)!r}; choose one of {[m.value for m in LossAggregation]}"
        ) from None


def kl_estimator(estimator: KLEstimator | str) -> KLEstimator:
    try:
        return KLEstimator(estimator)
    except ValueError:
        raise ValueError(
            f"unknown KL estimator {str(estimator)!r}; choose one of {[k.value for k in KLEstimator]}"
        ) from None


def group_advantages(
    rewards: Tensor,
    group_size: int,
    normalize_std: bool = True,
    eps: float = 1e-6,
    scored: Tensor | None = None,
) -> Tensor:
    """A_i = (r_i - mean_g) / (std_g + eps) over contiguous groups of `group_size` responses.

    std is the unbiased sample std (torch.std, Bessel-corrected), as the GRPO reference implementations
    use; a group of one has std 0 (its advantage is 0). `normalize_std=False` is Dr.GRPO: A_i = r_i - mean_g.
    `scored` (bool per response): only those have a reward; a group's mean and std are over them, and the
    others get advantage 0 (their loss is masked out too).
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [num_groups * group_size], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    if scored is not None and not bool(scored.all()):
        return _scored_group_advantages(rewards, scored, group_size, normalize_std, eps)
    grouped = rewards.detach().float().view(-1, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std:
        std = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(grouped[:, :1])
        centered = centered / (std + eps)
    return centered.reshape(-1)


def _scored_group_advantages(
    rewards: Tensor, scored: Tensor, group_size: int, normalize_std: bool, eps: float
) -> Tensor:
    """`group_advantages` over the scored responses of each group only (0 for the others)."""
    grouped = rewards.detach().float().view(-1, group_size)
    mask = scored.view(-1, group_size).float()
    count = mask.sum(dim=1, keepdim=True)
    mean = (grouped * mask).sum(dim=1, keepdim=True) / count.clamp(min=1.0)
    centered = (grouped - mean) * mask
    if normalize_std:
        var = centered.square().sum(dim=1, keepdim=True) / (count - 1.0).clamp(min=1.0)
        std = torch.where(count > 1, var.sqrt(), torch.zeros_like(var))
        centered = centered / (std + eps)
    return centered.reshape(-1)


# The float32 logits held at once by token_logprobs and entropy_from_logits: whole rows, as many as fit.
LOGITS_CHUNK_BYTES = 64 * 2**20


def _row_chunks(logits: Tensor) -> list[slice]:
    """Slices of whole rows (sequences) whose float32 copy fits LOGITS_CHUNK_BYTES, at least one row each.

    At a real vocabulary one row [T, V] is already large, so the [B, T, V] float32 log-softmax is never
    materialised. Small models get one vectorised pass instead of a Python loop over rows, with bitwise
    equal results.
    """
    row_bytes = max(1, logits[0].numel() * 4)
    rows = max(1, LOGITS_CHUNK_BYTES // row_bytes)
    return [slice(start, start + rows) for start in range(0, logits.shape[0], rows)]


def token_logprobs(logits: Tensor, input_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits[:, :-1] / T) at input_ids[:, 1:] -> [B, T-1], float32, differentiable.

    Gather minus logsumexp over chunks of rows (`_row_chunks`), so the float32 copy of the logits stays
    bounded. temperature 0 (greedy) means unscaled.
    """
    if logits.dim() != 3 or input_ids.shape != logits.shape[:2]:
        raise ValueError(f"logits [B, T, V] and input_ids [B, T] expected, got {tuple(logits.shape)} and "
                         f"{tuple(input_ids.shape)}")  # fmt: skip
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    scale = 1.0 / temperature if temperature > 0 else 1.0
    parts = []
    for rows in _row_chunks(logits):
        chunk = logits[rows, :-1].float()
        if scale != 1.0:
            chunk = chunk * scale
        target = input_ids[rows, 1:].unsqueeze(-1)
        parts.append(chunk.gather(-1, target).squeeze(-1) - torch.logsumexp(chunk, dim=-1))
    return torch.cat(parts)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) at every position -> [B, T] float32 (H = logsumexp(l) - sum p*l)."""
    parts = []
    for rows in _row_chunks(logits):
        chunk = logits[rows].float()
        probs = torch.softmax(chunk, dim=-1)
        weighted = torch.where(probs > 0, probs * chunk, torch.zeros_like(chunk))  # 0 * -inf logits -> 0
        parts.append(torch.logsumexp(chunk, dim=-1) - weighted.sum(dim=-1))
    return torch.cat(parts)


def _token_mean(masked: Tensor, mask: Tensor, max_len: int | None) -> Tensor:
    return masked.sum() / mask.sum().clamp(min=1.0)


def _seq_mean_token_mean(masked: Tensor, mask: Tensor, max_len: int | None) -> Tensor:
    counts = mask.sum(dim=-1)
    per_seq = masked.sum(dim=-1) / counts.clamp(min=1.0)
    has_tokens = (counts > 0).to(masked.dtype)
    return (per_seq * has_tokens).sum() / has_tokens.sum().clamp(min=1.0)


def _seq_mean_token_sum(masked: Tensor, mask: Tensor, max_len: int | None) -> Tensor:
    norm = float(max_len if max_len is not None else masked.shape[-1])
    return (masked.sum(dim=-1) / norm).mean()


AGGREGATE: dict[LossAggregation, Callable[[Tensor, Tensor, int | None], Tensor]] = {
    LossAggregation.token_mean: _token_mean,
    LossAggregation.seq_mean_token_mean: _seq_mean_token_mean,
    LossAggregation.seq_mean_token_sum: _seq_mean_token_sum,
}


def aggregate(
    values: Tensor, mask: Tensor, mode: LossAggregation | str, max_len: int | None = None
) -> Tensor:
    """Reduce per-token values [B, L] over the masked tokens to a scalar.

    token_mean: sum(v*m) / sum(m) (DAPO: every token weighs the same).
    seq_mean_token_mean: mean over sequences of each sequence's token mean (original GRPO); sequences
      without any masked token are left out.
    seq_mean_token_sum: mean over sequences of sum(v*m) / max_len (Dr.GRPO: a constant normaliser, so
      long responses are not down-weighted); max_len defaults to L, pass the response cap to make it
      constant across batches.
    An all-zero mask gives 0 (with the graph kept, so backward still works).
    """
    reduce = AGGREGATE[loss_aggregation(mode)]
    mask = mask.to(values.dtype)
    return reduce(values * mask, mask, max_len)


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    eps_clip_low: float,
    eps_clip_high: float,
    aggregation: LossAggregation | str = LossAggregation.token_mean,
    tis_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO-clip surrogate with asymmetric clipping (DAPO clip-higher), optionally TIS-weighted.

    ratio = exp(logp - old); per token pg = -min(ratio*A, clip(ratio, 1-eps_low, 1+eps_high)*A), times
    the detached TIS weight if given; reduced with `aggregate`. `advantages` is per sequence [B] or per
    token [B, L]. Metrics: clipfrac (fraction of masked tokens where the clipped branch is the active
    one, i.e. the gradient is cut), ratio_mean (masked mean ratio).
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    advantages = advantages.detach().to(logprobs.dtype)
    log_ratio = (logprobs - old_logprobs.detach()).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1.0 - eps_clip_low, 1.0 + eps_clip_high) * advantages
    pg = torch.maximum(unclipped, clipped)
    if tis_weights is not None:
        pg = pg * tis_weights.detach()
    loss = aggregate(pg, loss_mask, aggregation)
    with torch.no_grad():
        mask = loss_mask.to(torch.float32)
        denom = mask.sum().clamp(min=1.0)
        clipfrac = ((clipped > unclipped).float() * mask).sum() / denom
        ratio_mean = (ratio.float() * mask).sum() / denom
    return loss, {"clipfrac": float(clipfrac), "ratio_mean": float(ratio_mean)}


def _k1(log_ratio: Tensor) -> Tensor:
    return log_ratio


def _k2(log_ratio: Tensor) -> Tensor:
    return 0.5 * log_ratio.square()


def _k3(log_ratio: Tensor) -> Tensor:
    neg = (-log_ratio).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return (torch.exp(neg) - neg - 1.0).clamp(-10.0, 10.0)


KL_ESTIMATE: dict[KLEstimator, Callable[[Tensor], Tensor]] = {
    KLEstimator.k1: _k1,
    KLEstimator.k2: _k2,
    KLEstimator.k3: _k3,
}


def kl_penalty(
    logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator | str = KLEstimator.k3
) -> Tensor:
    """Per-token KL(pi || ref) estimate from sampled tokens (Schulman's k1/k2/k3).

    k1 = logp - ref; k2 = (logp - ref)^2 / 2; k3 = exp(ref - logp) - (ref - logp) - 1 (unbiased, >= 0,
    low variance), with the log ratio clamped to +-20 and k3 to [-10, 10] for stability.
    """
    estimate = KL_ESTIMATE[kl_estimator(estimator)]
    return estimate(logprobs.float() - ref_logprobs.float())
