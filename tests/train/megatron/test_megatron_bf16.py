"""The Megatron model in bf16 (as the recipe trains) against transformers' DeepseekV4ForCausalLM in bf16
(loaded as `from_pretrained(dtype=torch.bfloat16)` loads it) and in float32, same weights, world size 1
(scenarios.py --dtype bfloat16, forward only).

The tolerance. bf16 keeps 8 significant bits: each rounding moves a value by up to 2^-9 (0.2%). A
token's log-prob is a logit minus a log-sum-exp after a few hundred such roundings of O(1) values across
the layers, and the two implementations round at different points (the port where SGLang does, in
float32 inside the mHC mixes, the attention core, the compressors and RoPE; transformers in bf16 there),
so their continuous error is a few 1e-3 nats a token: the median |difference| measured here is 0.003 to
0.005 nats, against float32 and between the two. On top of it come discrete choices: a token whose
top-2 of 8 experts (score routing) or whose indexer top-8 has two candidates within bf16 noise of each
other can choose differently, moving its log-prob by up to ~0.4 nats (3-5% of the tokens move more than
0.05). So no per-token bound holds; the bounds are on the median (the continuous error, limit
MEDIAN_NATS = 0.015, about three times the largest measured) and on the mean (the flips included, limit
MEAN_NATS = 0.03, about three times the largest measured 0.011). A mapping bug (a wrong, split or transposed
tensor) moves most tokens by 0.1 nats or more and fails both; one rounding point done in bf16 does not,
which is why test_megatron_precision.py checks those one by one.

And, on the same (bf16) weights, the port's bf16 log-probs are no farther from float32 arithmetic than
transformers' bf16 ones are (measured: 0.71-0.72 of their median distance, 0.60-0.62 of their mean). At
this size a few expert-choice flips weigh much in these statistics, so this is a check of the whole
model's direction.
"""

from __future__ import annotations

import pytest
import torch
from test_megatron_model import _launch, collect

CONFIGS = ("tiny", "selecting")  # every layer kind; selecting adds top-k choices, 160 tokens, padding
MEDIAN_NATS = 0.015
MEAN_NATS = 0.03


@pytest.fixture(scope="module")
def bf16_runs(tmp_path_factory) -> dict[str, dict]:
    """Every config in bf16 at world size 1, concurrently (one process each)."""
    root = tmp_path_factory.mktemp("megatron_bf16")
    return collect(
        {
            c: (_launch(root / f"{c}.pt", c, 1, 1, 1, None, dtype="bfloat16"), root / f"{c}.pt")
            for c in CONFIGS
        }
    )


def _real(result: dict, logprobs: torch.Tensor) -> torch.Tensor:
    """The log-probs of real target tokens (right padding dropped), flattened."""
    return torch.cat([logprobs[row, : length - 1] for row, length in enumerate(result["lengths"])])


def _distance(result: dict, key: str) -> tuple[float, float]:
    """(median, mean) |port - result[key]| over the real tokens."""
    difference = (_real(result, result["logprobs"]) - _real(result, result[key])).abs()
    return float(difference.median()), float(difference.mean())


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("against", ["reference_bf16_logprobs", "reference_logprobs"], ids=["bf16", "fp32"])
def test_bf16_logprobs_match_transformers(bf16_runs, config, against):
    result = bf16_runs[config]
    assert result["logprobs"].shape == result[against].shape
    median, mean = _distance(result, against)
    assert median < MEDIAN_NATS and mean < MEAN_NATS, (median, mean)


@pytest.mark.parametrize("config", CONFIGS)
def test_bf16_is_nearer_float32_arithmetic_than_transformers(bf16_runs, config):
    result = bf16_runs[config]
    exact = _real(result, result["reference_bf16_weights_logprobs"])
    port = (_real(result, result["logprobs"]) - exact).abs()
    transformers = (_real(result, result["reference_bf16_logprobs"]) - exact).abs()
    assert port.median() <= transformers.median(), (float(port.median()), float(transformers.median()))
    assert port.mean() <= transformers.mean(), (float(port.mean()), float(transformers.mean()))
