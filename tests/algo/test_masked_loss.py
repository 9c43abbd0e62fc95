"""Targets with loss mask 0 inside a response (tool results, turn tokens the chat template inserts in a
multi-turn rollout) add no term to the loss or to any metric: their logits rows get exactly zero gradient,
the loss is the one written over the mask-1 targets alone (`handwritten_loss`), the normalisers count
mask-1 targets only, and whatever log-probs sit at mask-0 targets (the engine's 0.0, the old policy's, the
reference's, even non-finite rollout values) change nothing. The backends: test_masked_loss_backends.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from dsv4rl.algo.grpo import token_logprobs
from dsv4rl.algo.loss import (
    ABS_DIFF,
    CLIPPED,
    ENTROPY,
    KL,
    LOSS,
    MIS_MASKED,
    NUM_STEP_SUMS,
    TIS_CLIPPED,
    TOKENS,
    from_training_forward,
    micro_batch_loss,
    normaliser_share,
    rollout_corrections,
    step_metrics,
    step_sums,
)
from dsv4rl.algo.metrics import mismatch_metrics
from dsv4rl.algo.mismatch import abs_diff_summary, correction_weights
from dsv4rl.config.schema import AlgoConfig

MODES = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
MAX_LEN = 40  # the response cap seq_mean_token_sum divides by


def features(mode: str = "token_mean") -> AlgoConfig:
    """Every loss term on: PPO clip-higher, TIS, MIS, KL to a reference (k3), entropy bonus."""
    algo = AlgoConfig(loss_aggregation=mode, kl_coef=0.1, kl_estimator="k3", entropy_coef=0.02)
    algo.tis.enabled, algo.tis.clip = True, 1.3
    algo.mis.enabled, algo.mis.low, algo.mis.high = True, 0.6, 1.6
    return algo


def handwritten_loss(
    logits: Tensor,
    ids: Tensor,
    mask: Tensor,
    advantages: Tensor,
    rollout: Tensor,
    old: Tensor | None,
    ref: Tensor | None,
    algo: AlgoConfig,
    temperature: float,
    normaliser: float,
    per_sequence: Tensor | None = None,
) -> Tensor:
    """The GRPO loss written over the mask-1 targets alone, token by token, independently of dsv4rl.algo:
    sum over them of PPO-clip x TIS x MIS + kl_coef k3(ref) - entropy_coef H, divided by `normaliser`
    (token_mean: the number of mask-1 targets). `old` None: the policy's own detached log-probs (one update
    per batch). `per_sequence` [B]: each sequence's factor (seq_mean_token_mean: 1 / its mask-1 count)."""
    total = logits.new_zeros((), dtype=torch.float64)
    for b, t in (mask > 0).nonzero().tolist():
        row = logits[b, t].double() / temperature
        log_p = torch.log_softmax(row, dim=-1)
        logp = log_p[ids[b, t + 1]]
        o = logp.detach() if old is None else old[b, t].double()
        ratio = torch.exp(logp - o)
        a = float(advantages[b])
        eps_low, eps_high = algo.eps_clip_low, algo.eps_clip_high
        term = -torch.minimum(ratio * a, ratio.clamp(1 - eps_low, 1 + eps_high) * a)
        engine = math.exp(float(o) - float(rollout[b, t]))  # old / rollout
        if algo.tis.enabled:
            term = term * min(engine, algo.tis.clip)
        if algo.mis.enabled and not algo.mis.low <= engine <= algo.mis.high:
            term = term * 0.0
        if ref is not None:
            d = ref[b, t].double() - logp
            term = term + algo.kl_coef * (torch.exp(d) - d - 1.0)
        if algo.entropy_coef:
            term = term + algo.entropy_coef * (log_p.exp() * log_p).sum()  # minus the entropy
        total = total + term * (1.0 if per_sequence is None else float(per_sequence[b]))
    return total / normaliser


def _pieces(seed: int = 0, tool_span: int = 3) -> dict[str, Tensor]:
    """3 sequences whose responses interleave sampled targets (mask 1) and inserted ones (mask 0, the
    engine's log-prob 0.0 there), in float64 so sums compare at 1e-12."""
    g = torch.Generator().manual_seed(seed)
    masks = []
    for prompt, spans in ((2, [3, 2, 4]), (3, [2, 5, 1, 2]), (1, [4])):
        row, sampled = [0.0] * prompt, True
        for n in spans:
            row += [1.0 if sampled else 0.0] * (n if sampled else tool_span)
            sampled = not sampled
        masks.append(row)
    width = max(map(len, masks)) + 2  # right padding (mask 0)
    mask = torch.tensor([r + [0.0] * (width - len(r)) for r in masks], dtype=torch.float64)
    b, vocab = mask.shape[0], 13
    logits = torch.randn(b, width + 1, vocab, generator=g, dtype=torch.float64) * 1.5
    ids = torch.randint(0, vocab, (b, width + 1), generator=g)
    policy = token_logprobs(logits, ids, 0.8)
    noise = 0.4 * torch.randn(b, width, generator=g, dtype=torch.float64)
    return {
        "logits": logits,
        "ids": ids,
        "mask": mask,
        "advantages": torch.tensor([1.0, -0.7, 0.4], dtype=torch.float64),
        "rollout": (policy + noise) * mask,  # the engine's: 0.0 at inserted targets
        "old": policy + 0.3 * torch.randn(b, width, generator=g, dtype=torch.float64),
        "ref": policy - 0.2 * torch.rand(b, width, generator=g, dtype=torch.float64),
    }


def _scrambled(p: dict[str, Tensor], names: tuple[str, ...], seed: int = 1) -> dict[str, Tensor]:
    """`p` with the per-token tensors `names` replaced by garbage at every mask-0 target."""
    g = torch.Generator().manual_seed(seed)
    out = dict(p)
    off = p["mask"] == 0
    for name in names:
        garbage = torch.empty_like(p[name]).uniform_(-60.0, 8.0, generator=g)
        out[name] = torch.where(off, garbage, p[name])
    return out


def _run(p: dict[str, Tensor], mode: str = "token_mean", reuse: bool = False) -> dict:
    """One micro-batch through the shared loss as train/update.py runs it: the loss over the global
    normaliser, its gradient w.r.t. the logits, the micro-batch's sums and the step's metrics."""
    algo = features(mode)
    logits = p["logits"].clone().requires_grad_(True)
    logprobs = token_logprobs(logits, p["ids"], 0.8)
    mask = p["mask"]
    if reuse:
        old, tis, sums = from_training_forward(algo, logprobs, p["rollout"], mask, True)
    else:
        old = p["old"]
        tis, corrections = rollout_corrections(algo, old, p["rollout"], mask)
        sums = step_sums(old, p["rollout"], mask, corrections, True)
    out = micro_batch_loss(
        logprobs, logits, old, p["advantages"], mask, algo, 0.8, ref_logprobs=p["ref"], tis_weights=tis
    )
    denom = float(normaliser_share(mask, mode, MAX_LEN))
    loss = out.loss_sum / denom
    (grad,) = torch.autograd.grad(loss, logits)
    sums = sums.clone()
    sums[LOSS] += float(loss.detach())
    sums[ENTROPY] += out.entropy_sum
    sums[CLIPPED] += out.clipped_tokens
    sums[KL] += out.ref_kl_sum
    rows = mask > 0
    return {
        "loss": loss.detach(),
        "grad": grad,
        "sums": sums,
        "tis": None if tis is None else tis[rows],
        "metrics": step_metrics(sums, 1, [1.0], [1e-3], True),
    }


def _normaliser_and_factor(mask: Tensor, mode: str) -> tuple[float, Tensor | None]:
    counts = mask.sum(dim=1)
    if mode == "token_mean":
        return float(counts.sum()), None
    if mode == "seq_mean_token_mean":
        return float((counts > 0).sum()), 1.0 / counts.clamp(min=1.0)
    return float(mask.shape[0] * MAX_LEN), None


@pytest.mark.parametrize("reuse", [False, True], ids=["old_given", "old_from_training_forward"])
@pytest.mark.parametrize("mode", MODES)
def test_mask0_logits_rows_get_zero_gradient_and_the_loss_is_the_mask1_loss(mode, reuse):
    p = _pieces()
    got = _run(p, mode, reuse)
    mask = p["mask"]
    # rows of mask-0 targets (and the last position, which scores no target): exactly zero
    off = torch.cat([mask == 0, torch.ones(mask.shape[0], 1, dtype=torch.bool)], dim=1)
    assert got["grad"][off].abs().max() == 0.0
    assert got["grad"][~off].abs().amax(dim=-1).min() > 0  # every mask-1 row gets a gradient
    # the same loss over the mask-1 targets alone, written independently
    logits = p["logits"].clone().requires_grad_(True)
    normaliser, factor = _normaliser_and_factor(mask, mode)
    old = None if reuse else p["old"]
    want = handwritten_loss(
        logits, p["ids"], mask, p["advantages"], p["rollout"], old, p["ref"], features(mode), 0.8,
        normaliser, factor,
    )  # fmt: skip
    (want_grad,) = torch.autograd.grad(want, logits)
    # (dsv4rl.algo computes log-probs and entropies in float32, the hand-written loss in float64)
    assert float(got["loss"]) == pytest.approx(float(want.detach()), rel=1e-6)
    torch.testing.assert_close(got["grad"], want_grad, rtol=1e-5, atol=1e-8)
    # the terms are live: MIS dropped some tokens, TIS clipped some, PPO clipped some (old given)
    sums = got["sums"]
    assert 0 < float(sums[MIS_MASKED]) < float(sums[TOKENS]) and float(sums[TIS_CLIPPED]) > 0
    assert reuse or float(sums[CLIPPED]) > 0


def _widened(p: dict[str, Tensor], repeat: int) -> dict[str, Tensor]:
    """`p` with every interior mask-0 target of a response repeated `repeat` times (more tool-output
    tokens: the mask-1 targets keep their logits, ids and log-probs), right-padded to one width."""
    rows: list[list[int]] = []
    for mask in p["mask"]:
        on = mask.nonzero().flatten()
        first, last = int(on.min()), int(on.max())
        cols: list[int] = []
        for t in range(mask.numel()):
            interior = first < t < last and mask[t] == 0
            cols += [t] * (repeat if interior else 1)
        rows.append(cols)
    width = max(map(len, rows))
    out = {k: [] for k in ("logits", "ids", "mask", "rollout", "old", "ref")}
    for b, cols in enumerate(rows):
        pad = width - len(cols)
        index = torch.tensor(cols + [cols[-1]] * pad)
        out["mask"].append(
            torch.cat([p["mask"][b, index[: len(cols)]], torch.zeros(pad, dtype=torch.float64)])
        )
        for name in ("rollout", "old", "ref"):
            out[name].append(p[name][b, index])
        # logits row t and target id t+1 score target t: keep them together; the last row scores nothing
        out["logits"].append(torch.cat([p["logits"][b, index], p["logits"][b, -1:]]))
        out["ids"].append(torch.cat([p["ids"][b, :1], p["ids"][b, index + 1]]))
    widened = {k: torch.stack(v) for k, v in out.items()}
    widened["advantages"] = p["advantages"]
    return widened


def _interior_zeros(mask: Tensor) -> int:
    """Mask-0 targets between a response's first and last mask-1 target."""
    total = 0
    for row in mask:
        on = row.nonzero().flatten()
        total += int((row[int(on.min()) : int(on.max())] == 0).sum())
    return total


@pytest.mark.parametrize("mode", MODES)
def test_more_mask0_tokens_leave_the_loss_the_normaliser_and_the_metrics_unchanged(mode):
    p = _pieces()
    doubled = _widened(p, 2)
    assert _interior_zeros(doubled["mask"]) == 2 * _interior_zeros(p["mask"]) > 0  # more tool tokens
    assert torch.equal(doubled["mask"].sum(dim=1), p["mask"].sum(dim=1))
    assert float(normaliser_share(doubled["mask"], mode, MAX_LEN)) == float(
        normaliser_share(p["mask"], mode, MAX_LEN)
    )
    for reuse in (False, True):
        a, b = _run(p, mode, reuse), _run(doubled, mode, reuse)
        # the same float32 values, summed over more (zero) entries: equal to float32 rounding
        assert float(b["loss"]) == pytest.approx(float(a["loss"]), rel=1e-6)
        torch.testing.assert_close(b["sums"], a["sums"], rtol=1e-6, atol=1e-9)
        assert b["metrics"] == pytest.approx(a["metrics"], rel=1e-6, abs=1e-9)
        # the gradient of each mask-1 row is unchanged
        rows_a = a["grad"][:, :-1][p["mask"] > 0]
        rows_b = b["grad"][:, :-1][doubled["mask"] > 0]
        torch.testing.assert_close(rows_b, rows_a, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("reuse", [False, True], ids=["old_given", "old_from_training_forward"])
@pytest.mark.parametrize("mode", MODES)
def test_logprobs_at_mask0_targets_change_nothing(mode, reuse):
    """Rollout, old and reference log-probs at mask-0 targets: loss, gradient, TIS/MIS weights and every
    metric bit for bit the same."""
    p = _pieces()
    base = _run(p, mode, reuse)
    scrambled = _scrambled(p, ("rollout", "old", "ref"))
    nonfinite = dict(scrambled)  # the engine's values there may be anything, -inf and NaN included
    off = (p["mask"] == 0).nonzero()
    for (b, t), value in zip(off[:3].tolist(), (-math.inf, math.inf, math.nan), strict=True):
        nonfinite["rollout"] = nonfinite["rollout"].clone()
        nonfinite["rollout"][b, t] = value
    for other in (scrambled, nonfinite):
        got = _run(other, mode, reuse)
        assert torch.equal(got["loss"], base["loss"])
        assert torch.equal(got["grad"], base["grad"])
        assert torch.equal(got["tis"], base["tis"])
        assert torch.equal(got["sums"], base["sums"])
        assert got["metrics"] == base["metrics"]
    for name in ("logprob_abs_diff", "kl", "entropy", "tis_clip_fraction", "mis_masked_fraction"):
        assert math.isfinite(base["metrics"][name]) and base["metrics"][name] > 0, name
    assert base["metrics"]["response_tokens"] == float(p["mask"].sum())


def test_per_token_advantages_at_mask0_targets_change_nothing():
    """Advantages are per sequence in a TrainBatch; `policy_loss` also takes them per token [B, T-1]: the
    values at mask-0 targets are ignored as well."""
    from dsv4rl.algo.grpo import policy_loss

    p = _pieces()
    g = torch.Generator().manual_seed(3)
    per_token = p["advantages"][:, None].expand_as(p["mask"]).clone()
    garbage = torch.where(p["mask"] > 0, per_token, 50.0 * torch.randn(per_token.shape, generator=g).double())
    results = []
    for advantages in (per_token, garbage):
        logits = p["logits"].clone().requires_grad_(True)
        logprobs = token_logprobs(logits, p["ids"], 0.8)
        loss, metrics = policy_loss(logprobs, p["old"], advantages, p["mask"], 0.2, 0.28)
        results.append((loss.detach(), torch.autograd.grad(loss, logits)[0], metrics))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert results[0][2] == results[1][2]


def test_mismatch_statistics_read_mask1_targets_only():
    p = _pieces()
    scrambled = _scrambled(p, ("rollout", "old"))
    assert mismatch_metrics(p["old"], p["rollout"], p["mask"]) == mismatch_metrics(
        scrambled["old"], scrambled["rollout"], p["mask"]
    )
    summary = abs_diff_summary(p["old"], p["rollout"], p["mask"])
    assert summary == abs_diff_summary(scrambled["old"], scrambled["rollout"], p["mask"])
    assert summary["tokens"] == int(p["mask"].sum())


def test_step_sums_count_mask1_targets_only():
    """`response_tokens` and every count/fraction's denominator is the number of mask-1 targets."""
    p = _pieces()
    algo = features()
    tis, corrections = rollout_corrections(algo, p["old"], p["rollout"], p["mask"])
    sums = step_sums(p["old"], p["rollout"], p["mask"], corrections, False)
    on = p["mask"] > 0
    assert sums.shape == (NUM_STEP_SUMS,) and float(sums[TOKENS]) == float(on.sum())
    diff = p["old"][on] - p["rollout"][on]
    assert float(sums[ABS_DIFF]) == pytest.approx(float(diff.abs().sum()), rel=1e-12)
    ratio = diff.exp()
    assert float(sums[TIS_CLIPPED]) == float((ratio > algo.tis.clip).sum())
    assert float(sums[MIS_MASKED]) == float(((ratio < algo.mis.low) | (ratio > algo.mis.high)).sum())
    k3 = (-diff).exp() + diff - 1.0  # KL(old || rollout) against the rollout when there is no reference
    assert float(sums[KL]) == pytest.approx(float(k3.sum()), rel=1e-6)  # k3 in float32
    assert tis is not None and torch.equal(tis[~on], torch.ones_like(tis[~on]))  # neutral where mask is 0
    # correction_weights itself (no neutral fill) counts only mask-1 targets too
    garbage = _scrambled(p, ("rollout",))["rollout"]
    clean = correction_weights(p["old"], p["rollout"], p["mask"], tis_clip=1.3, mis_bounds=(0.6, 1.6))[1]
    assert correction_weights(p["old"], garbage, p["mask"], tis_clip=1.3, mis_bounds=(0.6, 1.6))[1] == clean
