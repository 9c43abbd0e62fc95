"""The per-family tables between the reward functions and the trainer (`algo.name`)."""

from __future__ import annotations

import pytest
import torch

from dsv4rl.algo.families import (
    ADVANTAGES,
    GROUP_FILTERS,
    REWARD_SHAPING,
    compute_advantages,
    keep_groups,
    sampling_done,
    shape_rewards,
)
from dsv4rl.algo.grpo import group_advantages
from dsv4rl.config.choices import AlgorithmName
from dsv4rl.config.schema import AlgoConfig


def test_every_family_has_a_row_in_every_table() -> None:
    for table in (REWARD_SHAPING, GROUP_FILTERS, ADVANTAGES):
        assert set(table) == set(AlgorithmName)


def test_rewards_pass_through_without_overlong_shaping() -> None:
    rewards = shape_rewards(AlgoConfig(), [1.0, 0.0], [10, 3])
    assert torch.equal(rewards, torch.tensor([1.0, 0.0]))


@pytest.mark.parametrize("name", list(AlgorithmName))
def test_overlong_shaping_penalises_long_responses(name: AlgorithmName) -> None:
    algo = AlgoConfig(name=name)
    algo.overlong.enabled = True
    algo.overlong.expected_len, algo.overlong.buffer_len = 8, 4  # cap 12, penalty from 8
    rewards = shape_rewards(algo, [1.0, 1.0, 1.0], [8, 10, 12])
    assert torch.allclose(rewards, torch.tensor([1.0, 0.5, 0.0]))


def test_dynamic_sampling_keeps_groups_whose_rewards_differ_only_when_on() -> None:
    algo = AlgoConfig(group_size=2)
    rewards, scored = torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.ones(4, dtype=torch.bool)
    assert keep_groups(algo, rewards, scored) is None  # off: one round, every group kept
    algo.dynamic_sampling.enabled = True
    assert keep_groups(algo, rewards, scored).tolist() == [True, False]


def test_dynamic_sampling_stops_at_a_full_batch_or_the_oversample_budget() -> None:
    algo = AlgoConfig()
    algo.dynamic_sampling.max_oversample_factor = 3
    assert sampling_done(algo, kept=16, wanted=16, rounds=1, prompts=4)
    assert not sampling_done(algo, kept=8, wanted=16, rounds=2, prompts=4)
    assert sampling_done(algo, kept=8, wanted=16, rounds=3, prompts=4)


@pytest.mark.parametrize("normalize_std", [True, False])
def test_advantages_are_group_relative_and_follow_normalize_std(normalize_std: bool) -> None:
    algo = AlgoConfig(group_size=3, normalize_std=normalize_std)
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0, 0.0])
    scored = torch.tensor([True, True, False, True, True, True])
    expected = group_advantages(rewards, 3, normalize_std=normalize_std, scored=scored)
    assert torch.equal(compute_advantages(algo, rewards, scored), expected)
    assert compute_advantages(algo, rewards, scored)[2] == 0.0  # the unscored sample has none
