import math

import pytest
import torch

from dsv4rl.algo import grpo
from dsv4rl.algo.grpo import (
    aggregate,
    entropy_from_logits,
    group_advantages,
    kl_penalty,
    policy_loss,
    token_logprobs,
)
from dsv4rl.config.choices import KLEstimator, LossAggregation

LN = math.log


def test_group_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    # group 1: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = sqrt(1/3); group 2: all equal -> 0.
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    expected = torch.tensor([a, -a, -a, a, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(group_advantages(rewards, 4), expected)
    dr = group_advantages(rewards, 4, normalize_std=False)  # Dr.GRPO
    torch.testing.assert_close(dr, torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))
    assert torch.equal(group_advantages(torch.tensor([3.0, -2.0]), 1), torch.zeros(2))


def test_group_advantages_errors():
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(torch.zeros(8), 3)
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 4), 4)


def test_token_logprobs_hand_computed():
    # position 0: softmax([0, ln 3]) = [1/4, 3/4], target 1;
    # position 1: softmax([ln 2, 0]) = [2/3, 1/3], target 0.
    logits = torch.tensor([[[0.0, LN(3)], [LN(2), 0.0], [5.0, -5.0]]])
    input_ids = torch.tensor([[0, 1, 0]])
    torch.testing.assert_close(token_logprobs(logits, input_ids), torch.tensor([[LN(0.75), LN(2 / 3)]]))
    # temperature 2: softmax([0, ln 3 / 2]) -> p(1) = sqrt3 / (1 + sqrt3)
    t2 = token_logprobs(logits, input_ids, temperature=2.0)
    assert t2[0, 0].item() == pytest.approx(LN(math.sqrt(3) / (1 + math.sqrt(3))), abs=1e-6)
    torch.testing.assert_close(
        token_logprobs(logits, input_ids, temperature=0.0), token_logprobs(logits, input_ids)
    )


def test_token_logprobs_matches_log_softmax_fp32_and_grad():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, 11, generator=g)
    ids = torch.randint(0, 11, (3, 6), generator=g)
    ref = torch.log_softmax(logits[:, :-1] / 0.7, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(token_logprobs(logits, ids, 0.7), ref)
    out = token_logprobs(logits.bfloat16(), ids)
    assert out.dtype == torch.float32 and out.shape == (3, 5)
    leaf = logits.clone().requires_grad_()
    token_logprobs(leaf, ids).sum().backward()
    assert leaf.grad is not None and leaf.grad[:, -1].abs().sum() == 0  # last position predicts nothing
    with pytest.raises(ValueError, match="input_ids"):
        token_logprobs(logits, ids[:, :-1])


def test_row_chunks_bound_the_float32_copy_and_change_no_result(monkeypatch):
    """Chunks of whole rows (at least one) whose float32 copy fits the budget; values and gradients are the
    same whether the rows go in one chunk or several."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 4, 3, generator=g)
    ids = torch.randint(0, 3, (5, 4), generator=g)
    leaf = logits.clone().requires_grad_()
    whole = token_logprobs(leaf, ids, 0.7)
    (whole.sum() + entropy_from_logits(leaf).sum()).backward()
    whole_grad, entropy = leaf.grad.clone(), entropy_from_logits(logits)
    assert len(grpo._row_chunks(logits)) == 1
    row_bytes = 4 * 3 * 4
    monkeypatch.setattr(grpo, "LOGITS_CHUNK_BYTES", 2 * row_bytes + 1)
    assert grpo._row_chunks(logits) == [slice(0, 2), slice(2, 4), slice(4, 6)]
    leaf.grad = None
    chunked = token_logprobs(leaf, ids, 0.7)
    (chunked.sum() + entropy_from_logits(leaf).sum()).backward()
    assert torch.equal(chunked, whole) and torch.equal(entropy_from_logits(logits), entropy)
    assert torch.equal(leaf.grad, whole_grad)
    monkeypatch.setattr(grpo, "LOGITS_CHUNK_BYTES", 1)  # a row over budget still goes whole
    assert len(grpo._row_chunks(logits)) == 5
    assert torch.equal(token_logprobs(logits, ids, 0.7), whole.detach())


def test_entropy():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, LN(3), -math.inf, -math.inf]]])
    h = entropy_from_logits(logits)
    expected = torch.tensor([[LN(4), -(0.25 * LN(0.25) + 0.75 * LN(0.75))]])
    torch.testing.assert_close(h, expected)


def test_aggregate_modes():
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [7.0, 7.0, 7.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert aggregate(v, m, "token_mean").item() == pytest.approx(10 / 4)
    assert aggregate(v, m, "seq_mean_token_mean").item() == pytest.approx((2 + 4) / 2)  # empty row left out
    assert aggregate(v, m, LossAggregation.seq_mean_token_sum).item() == pytest.approx(
        (6 / 3 + 4 / 3 + 0) / 3
    )
    assert aggregate(v, m, "seq_mean_token_sum", max_len=10).item() == pytest.approx((0.6 + 0.4 + 0) / 3)
    leaf = v.clone().requires_grad_()
    zero = aggregate(leaf, torch.zeros_like(m), "token_mean")
    zero.backward()
    assert zero.item() == 0.0 and torch.equal(leaf.grad, torch.zeros_like(v))
    with pytest.raises(ValueError, match="unknown loss aggregation 'sum'"):
        aggregate(v, m, "sum")


def test_policy_loss_hand_computed():
    old = torch.log(torch.tensor([[0.2, 0.4, 0.4, 0.3]]))
    ratios = torch.tensor([[1.5, 0.5, 0.5, 1.0]])
    logp = old + torch.log(ratios)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4)
    loss, metrics = policy_loss(logp, old, adv, mask, 0.2, 0.28)
    # per token: -min(1.5, 1.28) = -1.28 (clipped) | -min(0.5, 0.8) = -0.5
    #            -min(-0.5, -0.8) = 0.8 (clipped)   | -min(-1, -1) = 1.0
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 0.8 + 1.0) / 4, abs=1e-6)
    assert metrics["clipfrac"] == pytest.approx(0.5)
    assert metrics["ratio_mean"] == pytest.approx((1.5 + 0.5 + 0.5 + 1.0) / 4)
    # mask out the two clipped tokens
    mask2 = torch.tensor([[0.0, 1.0, 0.0, 1.0]])
    loss2, m2 = policy_loss(logp, old, adv, mask2, 0.2, 0.28)
    assert loss2.item() == pytest.approx((-0.5 + 1.0) / 2, abs=1e-6) and m2["clipfrac"] == 0.0
    # per-sequence advantages broadcast over tokens; TIS weights scale each token's term
    loss3, _ = policy_loss(
        logp, old, torch.tensor([1.0]), mask, 0.2, 0.28, tis_weights=torch.full((1, 4), 0.5)
    )
    # A = +1 everywhere: -1.28 (clipped) | -0.5 | -0.5 | -1.0, each times 0.5
    assert loss3.item() == pytest.approx(0.5 * (-1.28 - 0.5 - 0.5 - 1.0) / 4, abs=1e-6)


def _one_sgd_step(advantage: float, log_ratio: float):
    """Logits of one sequence; returns (logp before, logp after, grad) of the target tokens."""
    torch.manual_seed(0)
    logits = torch.randn(1, 5, 7, requires_grad=True)
    ids = torch.tensor([[0, 3, 1, 4, 2]])
    logp = token_logprobs(logits, ids)
    old = logp.detach() - log_ratio  # ratio = exp(log_ratio) at the current parameters
    loss, _ = policy_loss(logp, old, torch.tensor([advantage]), torch.ones_like(logp), 0.2, 0.28)
    loss.backward()
    with torch.no_grad():
        after = token_logprobs(logits - 1.0 * logits.grad, ids)
    return logp.detach(), after, logits.grad


def test_positive_advantage_raises_logprob_negative_lowers_it():
    before, after, _ = _one_sgd_step(advantage=1.0, log_ratio=0.0)
    assert (after > before).all()
    before, after, _ = _one_sgd_step(advantage=-1.0, log_ratio=0.0)
    assert (after < before).all()


def test_clipping_stops_the_gradient():
    _, _, grad = _one_sgd_step(advantage=1.0, log_ratio=LN(1.5))  # ratio 1.5 > 1 + 0.28
    assert grad.abs().max().item() == 0.0
    _, _, grad = _one_sgd_step(advantage=-1.0, log_ratio=LN(0.5))  # ratio 0.5 < 1 - 0.2, A < 0
    assert grad.abs().max().item() == 0.0
    _, _, grad = _one_sgd_step(advantage=-1.0, log_ratio=LN(1.5))  # above the range but A < 0: not clipped
    assert grad.abs().max().item() > 0.0
    _, _, grad = _one_sgd_step(advantage=1.0, log_ratio=LN(1.2))  # inside [0.8, 1.28]
    assert grad.abs().max().item() > 0.0


def test_kl_estimators():
    logp, ref = torch.tensor([LN(0.5)]), torch.tensor([LN(0.25)])
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(LN(2))
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * LN(2) ** 2)
    assert kl_penalty(logp, ref, KLEstimator.k3).item() == pytest.approx(0.5 + LN(2) - 1)
    assert kl_penalty(ref, ref, "k3").item() == 0.0
    extreme = kl_penalty(torch.tensor([-100.0]), torch.tensor([0.0]), "k3")
    assert torch.isfinite(extreme).all() and extreme.item() == 10.0
    with pytest.raises(ValueError, match="k4"):
        kl_penalty(logp, ref, "k4")


def test_advantages_of_scored_samples_only() -> None:
    """A sample no reward function scored has advantage 0, and the group's mean and std leave it out."""
    rewards = torch.tensor([1.0, 0.0, 5.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    scored = torch.tensor([True, True, False, True, True, True, True, True])
    out = group_advantages(rewards, 4, scored=scored)
    first = group_advantages(torch.tensor([1.0, 0.0, 1.0]), 3)
    assert torch.allclose(out[[0, 1, 3]], first) and out[2] == 0.0
    assert torch.equal(out[4:], group_advantages(rewards[4:], 4))
    everything = torch.ones(8, dtype=torch.bool)
    assert torch.equal(group_advantages(rewards, 4, scored=everything), group_advantages(rewards, 4))
    lone = group_advantages(torch.tensor([3.0, 0.0]), 2, scored=torch.tensor([True, False]))
    assert lone.tolist() == [0.0, 0.0]
