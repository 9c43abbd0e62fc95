"""Corrections for the rollout engine sampling from a slightly different policy than the trainer computes.

The engine serves quantized weights and runs other kernels, so the log-prob of a sampled token under
the trainer's weights (`old`, before the update) differs from the engine's (`rollout`). With the
per-token ratio r = exp(old - rollout):
- token-level truncated importance sampling (TIS) weights each token's loss by min(r, clip);
- masked importance sampling (MIS) drops tokens whose r lies outside [low, high] from the loss (weight
  0; the loss normaliser is unchanged, so the remaining tokens keep their scale).
Both are detached weights multiplied into the per-token policy loss.
"""

from __future__ import annotations

import torch
from torch import Tensor

_MAX_LOG_RATIO = 20.0  # exp(20) ~ 5e8: one wild token cannot make inf/nan


def _log_ratio(old_logprobs: Tensor, rollout_logprobs: Tensor) -> Tensor:
    return (old_logprobs.float() - rollout_logprobs.float()).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)


def tis_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, clip: float) -> Tensor:
    """Truncated importance sampling: min(exp(old - rollout), clip), detached."""
    if clip <= 0:
        raise ValueError(f"TIS clip must be > 0 (algo.tis.clip), got {clip}")
    return torch.exp(_log_ratio(old_logprobs, rollout_logprobs)).clamp(max=clip).detach()


def mis_mask(old_logprobs: Tensor, rollout_logprobs: Tensor, low: float, high: float) -> Tensor:
    """Masked importance sampling: 1.0 where low <= exp(old - rollout) <= high, else 0.0 (float32)."""
    if not 0.0 < low <= 1.0 <= high:
        raise ValueError(f"MIS bounds must satisfy 0 < low <= 1 <= high (algo.mis), got [{low}, {high}]")
    ratio = torch.exp(_log_ratio(old_logprobs, rollout_logprobs))
    return ((ratio >= low) & (ratio <= high)).float()


def correction_weights(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    loss_mask: Tensor,
    *,
    tis_clip: float | None = None,
    mis_bounds: tuple[float, float] | None = None,
) -> tuple[Tensor | None, dict[str, float]]:
    """The combined per-token weights (None when both are off) and their counts over response tokens.

    Counts (sums over `loss_mask`, so they add up over micro-batches and ranks): `tis_clipped` tokens
    whose TIS weight hit the clip, `mis_masked` tokens MIS dropped.
    """
    mask = loss_mask.float()
    counts = {"tis_clipped": 0.0, "mis_masked": 0.0}
    weights = None
    if tis_clip is not None:
        weights = tis_weights(old_logprobs, rollout_logprobs, tis_clip)
        ratio = torch.exp(_log_ratio(old_logprobs, rollout_logprobs))
        counts["tis_clipped"] = float(((ratio > tis_clip).float() * mask).sum())
    if mis_bounds is not None:
        keep = mis_mask(old_logprobs, rollout_logprobs, *mis_bounds)
        counts["mis_masked"] = float(((1.0 - keep) * mask).sum())
        weights = keep if weights is None else weights * keep
    return weights, counts


def abs_diff_summary(
    trainer_logprobs: Tensor, rollout_logprobs: Tensor, loss_mask: Tensor
) -> dict[str, float]:
    """Mean, quantiles and max of |trainer - rollout| over the response tokens, plus their count and the
    mean signed difference and the low-variance KL(rollout || trainer) estimate (k3)."""
    mask = loss_mask.bool()
    diff = (trainer_logprobs.float() - rollout_logprobs.float())[mask]
    if diff.numel() == 0:
        raise ValueError("no response tokens to compare")
    absolute = diff.abs()
    quantiles = torch.quantile(absolute.double(), torch.tensor([0.5, 0.95, 0.99], dtype=torch.float64))
    log_ratio = (-diff).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)  # rollout - trainer
    return {
        "tokens": int(diff.numel()),
        "mean_abs_diff": float(absolute.mean()),
        "p50_abs_diff": float(quantiles[0]),
        "p95_abs_diff": float(quantiles[1]),
        "p99_abs_diff": float(quantiles[2]),
        "max_abs_diff": float(absolute.max()),
        "mean_diff": float(diff.mean()),
        "kl_k3": float((torch.exp(-log_ratio) + log_ratio - 1.0).mean()),
    }
