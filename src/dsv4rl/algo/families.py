"""What each algorithm family (`algo.name`) does between the reward functions and the trainer.

Three tables keyed by `AlgorithmName`, as verl's `core_algos` registers its estimators: the reward
shaping, the group filter of dynamic sampling, and the advantages. The loop looks its family up and
keeps only the order. GRPO and DAPO share one entry each: DAPO's additions (soft overlong punishment,
dynamic sampling) are switched by their own keys (`algo.overlong`, `algo.dynamic_sampling`), so a recipe
can take one without the other; a family with another estimator adds its own rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from dsv4rl.algo.dapo import keep_informative_groups, overlong_penalty
from dsv4rl.algo.grpo import group_advantages
from dsv4rl.config.choices import AlgorithmName
from dsv4rl.config.schema import AlgoConfig

# (algo, the reward functions' weighted sums, response lengths) -> rewards [N]
RewardShaping = Callable[[AlgoConfig, Sequence[float], Sequence[int]], Tensor]
# (algo, rewards [N], scored [N] bool) -> bool per group: kept, or None to keep every group in one round
GroupFilter = Callable[[AlgoConfig, Tensor, Tensor], Tensor | None]
# (algo, rewards [N], scored [N] bool) -> advantages [N]
Advantages = Callable[[AlgoConfig, Tensor, Tensor], Tensor]


def overlong_shaped(algo: AlgoConfig, totals: Sequence[float], lengths: Sequence[int]) -> Tensor:
    """The reward functions' weighted sum plus DAPO's soft overlong penalty when `algo.overlong` is on."""
    reward = torch.tensor(totals, dtype=torch.float32)
    if algo.overlong.enabled:
        overlong = algo.overlong
        max_len = overlong.expected_len + overlong.buffer_len
        reward = reward + overlong_penalty(
            torch.tensor(list(lengths)), max_len, overlong.buffer_len, overlong.penalty
        )
    return reward


def informative_groups(algo: AlgoConfig, rewards: Tensor, scored: Tensor) -> Tensor | None:
    """DAPO dynamic sampling: the groups whose rewards differ (None when `algo.dynamic_sampling` is off)."""
    if not algo.dynamic_sampling.enabled:
        return None
    return keep_informative_groups(rewards, algo.group_size, scored)


def group_relative(algo: AlgoConfig, rewards: Tensor, scored: Tensor) -> Tensor:
    """GRPO's group-relative advantages (Dr.GRPO with `algo.normalize_std` off)."""
    return group_advantages(rewards, algo.group_size, normalize_std=algo.normalize_std, scored=scored)


REWARD_SHAPING: dict[AlgorithmName, RewardShaping] = {
    AlgorithmName.grpo: overlong_shaped,
    AlgorithmName.dapo: overlong_shaped,
}
GROUP_FILTERS: dict[AlgorithmName, GroupFilter] = {
    AlgorithmName.grpo: informative_groups,
    AlgorithmName.dapo: informative_groups,
}
ADVANTAGES: dict[AlgorithmName, Advantages] = {
    AlgorithmName.grpo: group_relative,
    AlgorithmName.dapo: group_relative,
}


def shape_rewards(algo: AlgoConfig, totals: Sequence[float], lengths: Sequence[int]) -> Tensor:
    """This family's rewards from the reward functions' weighted sums."""
    return REWARD_SHAPING[algo.name](algo, totals, lengths)


def keep_groups(algo: AlgoConfig, rewards: Tensor, scored: Tensor) -> Tensor | None:
    """Bool per group that this family's dynamic sampling keeps; None: one round, every group kept."""
    return GROUP_FILTERS[algo.name](algo, rewards, scored)


def sampling_done(algo: AlgoConfig, kept: int, wanted: int, rounds: int, prompts: int) -> bool:
    """Dynamic sampling stops at a full batch or after `max_oversample_factor` times the prompts."""
    return kept >= wanted or rounds * prompts >= algo.dynamic_sampling.max_oversample_factor * prompts


def compute_advantages(algo: AlgoConfig, rewards: Tensor, scored: Tensor) -> Tensor:
    """This family's advantage per sample."""
    return ADVANTAGES[algo.name](algo, rewards, scored)
