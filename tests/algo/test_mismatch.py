"""TIS, MIS and the align statistics against hand-computed values."""

import math

import pytest
import torch

from dsv4rl.algo.mismatch import abs_diff_summary, correction_weights, mis_mask, tis_weights

LN = math.log


def test_tis_weights():
    old = torch.tensor([LN(0.3), LN(0.1), LN(0.2)], requires_grad=True)
    rollout = torch.tensor([LN(0.1), LN(0.2), LN(0.2)])
    w = tis_weights(old, rollout, clip=2.0)
    torch.testing.assert_close(w, torch.tensor([2.0, 0.5, 1.0]))
    assert not w.requires_grad
    with pytest.raises(ValueError, match="clip"):
        tis_weights(old, rollout, clip=0.0)


def test_mis_mask_drops_ratios_outside_the_bounds():
    # ratios old/rollout: 3.0, 0.25, 1.0, 2.0 (inclusive bound), 0.5 (inclusive bound)
    old = torch.tensor([LN(0.3), LN(0.05), LN(0.2), LN(0.4), LN(0.1)])
    rollout = torch.tensor([LN(0.1), LN(0.2), LN(0.2), LN(0.2), LN(0.2)])
    torch.testing.assert_close(mis_mask(old, rollout, 0.5, 2.0), torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0]))
    for low, high in [(0.0, 2.0), (1.5, 2.0), (0.5, 0.9)]:
        with pytest.raises(ValueError, match="0 < low <= 1 <= high"):
            mis_mask(old, rollout, low, high)


def test_correction_weights_combine_and_count_only_response_tokens():
    old = torch.tensor([[LN(0.3), LN(0.05), LN(0.2), LN(0.9)]])
    rollout = torch.tensor([[LN(0.1), LN(0.2), LN(0.2), LN(0.1)]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the last token is padding: not counted
    weights, counts = correction_weights(old, rollout, mask, tis_clip=2.0, mis_bounds=(0.5, 2.0))
    # TIS: min(3, 2)=2, 0.25, 1, (9 clipped) ; MIS keeps only 1.0
    torch.testing.assert_close(weights, torch.tensor([[0.0, 0.0, 1.0, 0.0]]))
    assert counts == {"tis_clipped": 1.0, "mis_masked": 2.0}
    tis_only, counts = correction_weights(old, rollout, mask, tis_clip=2.0)
    torch.testing.assert_close(tis_only, torch.tensor([[2.0, 0.25, 1.0, 2.0]]))
    assert counts == {"tis_clipped": 1.0, "mis_masked": 0.0}
    assert correction_weights(old, rollout, mask) == (None, {"tis_clipped": 0.0, "mis_masked": 0.0})


def test_mis_weights_remove_masked_tokens_from_the_policy_loss():
    from dsv4rl.algo.grpo import policy_loss

    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old = logp.detach().clone()
    rollout = old + torch.tensor([[0.0, 3.0, 0.0]])  # the middle token's ratio is e^-3: masked
    mask = torch.ones(1, 3)
    weights, _ = correction_weights(old, rollout, mask, mis_bounds=(0.5, 2.0))
    loss, _ = policy_loss(logp, old, torch.tensor([1.0]), mask, 0.2, 0.28, tis_weights=weights)
    loss.backward()
    assert logp.grad[0, 1] == 0.0 and logp.grad[0, 0] != 0.0 and logp.grad[0, 2] != 0.0


def test_abs_diff_summary():
    trainer = torch.tensor([[0.0, -1.0, -2.0, -3.0], [-1.0, -1.0, 5.0, 0.0]])
    rollout = torch.tensor([[0.0, -1.5, -2.0, -2.0], [-1.1, -1.0, 0.0, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])  # 5 tokens: |d| = .5, 0, 1, .1, 0
    summary = abs_diff_summary(trainer, rollout, mask)
    assert summary["tokens"] == 5
    assert summary["mean_abs_diff"] == pytest.approx(1.6 / 5)
    assert summary["max_abs_diff"] == pytest.approx(1.0)
    assert summary["p50_abs_diff"] == pytest.approx(0.1)
    assert summary["mean_diff"] == pytest.approx((0.5 + 0 - 1 + 0.1 + 0) / 5)
    k3 = [math.exp(d) - d - 1 for d in (0.5, 0.0, -1.0, 0.1, 0.0)]
    assert summary["kl_k3"] == pytest.approx(sum(k3) / 5, rel=1e-5)
    with pytest.raises(ValueError, match="no response tokens"):
        abs_diff_summary(trainer, rollout, torch.zeros_like(mask))
