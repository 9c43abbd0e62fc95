"""Sampling maths: filters, greedy, logprob convention, per-sequence generators."""

from __future__ import annotations

import torch

from dsv4rl.engine.sampling import SamplingParams, edit_logits, sample

LOGITS = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]])


def draw(params: SamplingParams, times: int = 200) -> set[int]:
    generator = torch.Generator().manual_seed(0)
    return {int(sample(LOGITS.clone(), [params], [generator])[0]) for _ in range(times)}


def test_filters_restrict_the_support():
    assert draw(SamplingParams(top_k=2)) == {0, 1}
    assert draw(SamplingParams(top_p=0.01)) == {0}
    assert draw(SamplingParams(min_p=0.3)) == {0, 1}  # p1/p0 = e^-1 = 0.37; p2/p0 = 0.22
    assert draw(SamplingParams()) == {0, 1, 2, 3, 4}


def test_logprob_is_before_filtering_and_scaled_by_temperature():
    params = SamplingParams(temperature=0.5, top_k=1)
    tokens, logprobs = sample(LOGITS.clone(), [params], [torch.Generator()])
    assert int(tokens[0]) == 0
    assert torch.allclose(logprobs, torch.log_softmax(LOGITS / 0.5, -1)[:, 0])
    greedy = SamplingParams(temperature=0.0)
    _, logprobs = sample(LOGITS.clone(), [greedy], [torch.Generator()])
    assert torch.allclose(logprobs, torch.log_softmax(LOGITS, -1)[:, 0])


def test_rows_draw_from_their_own_generators():
    params = [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams()]
    logits = LOGITS.repeat(3, 1)
    seeds = [torch.Generator().manual_seed(s) for s in (1, 2, 1)]
    runs = [sample(logits, params, seeds)[0].tolist() for _ in range(20)]
    assert all(run[0] == run[2] and run[1] == 0 for run in runs)


def test_penalties_and_min_new_tokens():
    logits = LOGITS[0].clone()
    edit_logits(logits, SamplingParams(min_new_tokens=2, presence_penalty=1.0), [0], stop_ids=[4])
    assert logits[4] == float("-inf") and logits[0] == 1.0 and logits[1] == 1.0
