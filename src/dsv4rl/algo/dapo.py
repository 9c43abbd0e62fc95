"""DAPO additions to GRPO: soft overlong punishment and dynamic sampling's group filter."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def overlong_penalty(
    lengths: Tensor | Sequence[int], max_len: int, buffer_len: int, penalty: float = 1.0
) -> Tensor:
    """Soft overlong punishment (DAPO eq. 13), added to the reward; values in [-penalty, 0].

    With expected = max_len - buffer_len: 0 for length <= expected, then falling linearly to -penalty
    at max_len, and -penalty beyond. DAPO's recipe: expected 16384 + buffer 4096, so max_len 20480
    (`algo.overlong.expected_len + algo.overlong.buffer_len`).
    """
    if buffer_len < 0 or buffer_len > max_len:
        raise ValueError(f"overlong buffer_len must be in [0, max_len={max_len}], got {buffer_len}")
    lengths = torch.as_tensor(lengths, dtype=torch.float32)
    expected = max_len - buffer_len
    if buffer_len == 0:
        return torch.where(lengths > max_len, -float(penalty), 0.0)
    frac = ((lengths - expected) / buffer_len).clamp(0.0, 1.0)
    return -float(penalty) * frac


def keep_informative_groups(rewards: Tensor, group_size: int, scored: Tensor | None = None) -> Tensor:
    """Bool[num_groups]: True where a group's rewards are not all equal (dynamic sampling keeps those;
    an all-equal group has zero advantage everywhere and contributes no gradient). `scored` (bool, per
    sample): only those rewards count (a sample no reward function scored has none)."""
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    grouped = rewards.view(-1, group_size)
    if scored is None or bool(scored.all()):
        return grouped.amax(dim=1) != grouped.amin(dim=1)
    mask = scored.view(-1, group_size)
    high = torch.where(mask, grouped, torch.full_like(grouped, -torch.inf)).amax(dim=1)
    low = torch.where(mask, grouped, torch.full_like(grouped, torch.inf)).amin(dim=1)
    return (mask.sum(dim=1) > 1) & (high != low)


def flat_group_fraction(rewards: Tensor, group_size: int, scored: Tensor | None = None) -> float:
    """The share of groups whose rewards are all equal (or with under two scored samples): groups that give
    no gradient. TRL logs it as `frac_reward_zero_std`; near 1 the run is not learning."""
    informative = keep_informative_groups(rewards, group_size, scored)
    return 1.0 - float(informative.float().mean()) if informative.numel() else 0.0
