"""The training loss, once for every engine: micro-batch sums over the global normaliser equal the
mini-batch's loss, and each term (PPO clip, TIS, KL, entropy) is the one the algo config asks for."""

from __future__ import annotations

import pytest
import torch

from dsv4rl.algo.grpo import aggregate, entropy_from_logits, kl_penalty, policy_loss, token_logprobs
from dsv4rl.algo.loss import gradient_scale, micro_batch_loss, normaliser_share, sum_factor
from dsv4rl.config.schema import AlgoConfig

MODES = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]


@pytest.mark.parametrize("mode", MODES)
def test_pieces_add_up_to_the_whole(mode):
    g = torch.Generator().manual_seed(0)
    values = torch.randn(7, 9, generator=g, dtype=torch.float64)
    mask = (torch.rand(7, 9, generator=g) > 0.4).double()
    mask[3] = 0  # a sequence without response tokens
    max_len = 9
    whole = aggregate(values, mask, mode, max_len=max_len if mode == "seq_mean_token_sum" else None)
    total, terms = 0.0, 0.0
    for rows in (slice(0, 3), slice(3, 5), slice(5, 7)):  # micro-batches / ranks
        v, m = values[rows], mask[rows]
        cols = int(m.any(0).nonzero().max()) + 1 if m.any() else 1  # trimmed like TrainBatch.trimmed
        v, m = v[:, :cols], m[:, :cols]
        total += float(aggregate(v, m, mode) * sum_factor(m, mode))
        terms += float(normaliser_share(m, mode, max_len))
    assert total / terms == pytest.approx(float(whole), rel=1e-12)


def test_gradient_scale_undoes_data_parallel_averaging_and_guards_empty_batches():
    assert gradient_scale(8.0, world=2) == 0.25
    assert gradient_scale(0.0, world=4) == 4.0  # no response token anywhere: the loss sum is 0 anyway


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 6, 11, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 11, (3, 6), generator=g)
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [0, 1, 0, 0, 0]], dtype=torch.float64)
    old = token_logprobs(logits.detach(), ids, 0.7) + 0.3 * torch.randn(
        3, 5, generator=g, dtype=torch.float64
    )
    ref = old - 0.2 * torch.rand(3, 5, generator=g, dtype=torch.float64)
    advantages = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    return logits, ids, mask, old, ref, advantages


@pytest.mark.parametrize("mode", MODES)
def test_every_term_is_the_one_the_config_asks_for(mode):
    logits, ids, mask, old, ref, advantages = _batch()
    algo = AlgoConfig(loss_aggregation=mode, kl_coef=0.1, kl_estimator="k2", entropy_coef=0.02)
    algo.eps_clip_low, algo.eps_clip_high = 0.1, 0.2
    tis = torch.full_like(old, 0.5)
    logp = token_logprobs(logits, ids, 0.7)
    out = micro_batch_loss(logp, logits, old, advantages, mask, algo, 0.7, ref_logprobs=ref, tis_weights=tis)
    pg, metrics = policy_loss(logp, old, advantages, mask, 0.1, 0.2, aggregation=mode, tis_weights=tis)
    entropy = entropy_from_logits(logits[:, :-1] / 0.7)
    expected = (
        pg + 0.1 * aggregate(kl_penalty(logp, ref, "k2"), mask, mode) - 0.02 * aggregate(entropy, mask, mode)
    ) * sum_factor(mask, mode)
    torch.testing.assert_close(out.loss_sum, expected, rtol=1e-6, atol=1e-6)  # entropy is float32
    assert torch.allclose(out.entropy_sum, (entropy * mask).sum())
    assert torch.allclose(out.ref_kl_sum, (kl_penalty(logp, ref, "k3") * mask).sum())
    assert float(out.clipped_tokens) == pytest.approx(metrics["clipfrac"] * float(mask.sum()))
    out.loss_sum.backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_without_reference_or_entropy_bonus_only_the_policy_term_carries_gradient():
    logits, ids, mask, old, _, advantages = _batch(1)
    algo = AlgoConfig(entropy_coef=0.0)
    logp = token_logprobs(logits, ids, 1.0)
    out = micro_batch_loss(logp, logits, old, advantages, mask, algo, 1.0)
    pg, _ = policy_loss(logp, old, advantages, mask, algo.eps_clip_low, algo.eps_clip_high)
    assert out.ref_kl_sum is None and not out.entropy_sum.requires_grad
    assert torch.equal(out.loss_sum, pg * mask.sum())
