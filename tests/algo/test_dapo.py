import math

import pytest
import torch

from dsv4rl.algo.dapo import flat_group_fraction, keep_informative_groups, overlong_penalty
from dsv4rl.algo.metrics import mismatch_metrics, pass_at_k


def test_overlong_penalty():
    lengths = torch.tensor([10, 16, 17, 18, 20, 25])
    torch.testing.assert_close(
        overlong_penalty(lengths, max_len=20, buffer_len=4), torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    )
    torch.testing.assert_close(overlong_penalty([18], 20, 4, penalty=0.5), torch.tensor([-0.25]))
    torch.testing.assert_close(overlong_penalty([20, 21], 20, 0), torch.tensor([0.0, -1.0]))
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty([1], 20, 30)


def test_keep_informative_groups():
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, -0.5, 0.0, 0.0, 0.0])
    assert keep_informative_groups(rewards, 4).tolist() == [True, False, False, True]
    with pytest.raises(ValueError, match="groups of 3"):
        keep_informative_groups(rewards, 3)


def test_pass_at_k():
    assert pass_at_k(8, 2, 1) == pytest.approx(0.25)
    assert pass_at_k(8, 2, 8) == 1.0
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)  # 1 - C(7,5)/C(10,5)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_mismatch_metrics():
    train = torch.tensor([[-1.0, -2.0, -3.0]])
    rollout = torch.tensor([[-1.5, -2.0, -9.0]])
    m = mismatch_metrics(train, rollout, torch.tensor([[1.0, 1.0, 0.0]]))
    assert m["train_rollout_logprob_abs_diff"] == pytest.approx(0.25)
    assert m["train_rollout_logprob_abs_diff_max"] == pytest.approx(0.5)
    assert m["train_rollout_kl"] == pytest.approx((math.exp(0.5) - 0.5 - 1) / 2)
    assert mismatch_metrics(train, rollout, torch.zeros(1, 3))["train_rollout_kl"] == 0.0


def test_informative_groups_count_scored_samples_only() -> None:
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 2.0, 0.0])
    scored = torch.tensor([True, False, True, True, True, False])
    assert keep_informative_groups(rewards, 3, scored).tolist() == [False, True]
    assert keep_informative_groups(rewards, 3).tolist() == [True, True]


def test_flat_group_fraction_counts_groups_without_a_gradient():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.5, 0.5, 2.0, 3.0])
    assert flat_group_fraction(rewards, 2) == 0.25  # (0.5, 0.5) is flat
    assert flat_group_fraction(torch.zeros(8), 4) == 1.0
    scored = torch.tensor([True, False, True, True, True, True, True, True])
    assert flat_group_fraction(rewards, 2, scored) == 0.5  # one scored sample: no spread, no gradient
    assert flat_group_fraction(torch.zeros(0), 4) == 0.0
