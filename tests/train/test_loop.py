"""The pure parts of the RL loop (the loop itself runs end to end in tests/e2e)."""

from __future__ import annotations

import torch

from dsv4rl.config.schema import Config
from dsv4rl.rollout.types import Sample
from dsv4rl.train.loop import rollout_seed, shape_rewards


def sample(length: int) -> Sample:
    return Sample(0, [0, 5], [7] * length, [-0.1] * length, "", "length")


def test_rollout_seeds_differ_by_step_and_attempt_and_repeat() -> None:
    seeds = {rollout_seed(0, step, attempt) for step in range(1, 50) for attempt in range(3)}
    assert len(seeds) == 49 * 3
    assert rollout_seed(3, 10) == rollout_seed(3, 10)
    assert all(0 <= seed < 2**31 for seed in seeds)


def test_rewards_pass_through_without_overlong_shaping() -> None:
    cfg = Config()
    assert torch.equal(shape_rewards(cfg, [sample(10), sample(3)], [1.0, 0.0]), torch.tensor([1.0, 0.0]))


def test_overlong_shaping_penalises_long_responses() -> None:
    cfg = Config()
    cfg.algo.overlong.enabled = True
    cfg.algo.overlong.expected_len, cfg.algo.overlong.buffer_len = 8, 4  # cap 12, penalty from 8
    rewards = shape_rewards(cfg, [sample(8), sample(10), sample(12)], [1.0, 1.0, 1.0])
    assert torch.allclose(rewards, torch.tensor([1.0, 0.5, 0.0]))
