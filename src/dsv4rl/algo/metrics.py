"""Evaluation and train-rollout mismatch statistics (pure functions; the loop decides what to log)."""

from __future__ import annotations

import torch
from torch import Tensor


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021) from n samples with c correct: 1 - C(n-c, k) / C(n, k).

    Computed as 1 - prod_{i=n-c+1..n} (1 - k/i), which avoids huge binomials; pass@1 = c / n.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def mismatch_metrics(train_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> dict[str, float]:
    """How far the trainer's log-probs of the sampled tokens are from the rollout engine's.

    train_rollout_logprob_abs_diff (mean |diff|), its p95/p99/max, and train_rollout_kl (k3 of the
    rollout policy against the trainer's, mean over masked tokens).
    """
    sel = mask.bool()
    if not bool(sel.any()):
        return {k: 0.0 for k in ("train_rollout_logprob_abs_diff", "train_rollout_logprob_abs_diff_p95",
                                 "train_rollout_logprob_abs_diff_p99", "train_rollout_logprob_abs_diff_max",
                                 "train_rollout_kl")}  # fmt: skip
    diff = (train_logprobs.detach().float() - rollout_logprobs.float())[sel]
    absd = diff.abs()
    # k3 estimate of KL(rollout || train) from rollout samples: r = p_train / p_rollout.
    log_r = diff.clamp(-20.0, 20.0)
    kl = torch.exp(log_r) - log_r - 1.0
    return {
        "train_rollout_logprob_abs_diff": float(absd.mean()),
        "train_rollout_logprob_abs_diff_p95": float(torch.quantile(absd, 0.95)),
        "train_rollout_logprob_abs_diff_p99": float(torch.quantile(absd, 0.99)),
        "train_rollout_logprob_abs_diff_max": float(absd.max()),
        "train_rollout_kl": float(kl.mean()),
    }
