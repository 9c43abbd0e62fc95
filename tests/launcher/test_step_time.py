"""The step-time estimate: rollout, train and sync seconds checked by hand, with and without async."""

from __future__ import annotations

import copy

import pytest
from typer.testing import CliRunner

from dsv4rl.cli import app
from dsv4rl.config.choices import QuantMode, RecomputeMode
from dsv4rl.config.compose import compose
from dsv4rl.config.schema import Config
from dsv4rl.estimate.step_time import (
    flops_per_token_param,
    generated_tokens,
    step_seconds,
    step_time,
    train_seconds,
)
from dsv4rl.launcher.estimate_view import step_time_json

FP8_ROLLOUT_BYTES = 285_128_139_137.5  # DeepSeek-V4-Flash in quant=fp8_rollout (test_memory_plan)
MXFP4_BYTES = 155_204_854_145.5


@pytest.fixture(scope="module")
def dapo_base() -> Config:
    return compose("dapo_math")


@pytest.fixture
def dapo(dapo_base: Config) -> Config:
    return copy.deepcopy(dapo_base)


def test_the_pieces_by_hand() -> None:
    assert generated_tokens(32, 8, 4096, 0.75) == 786_432

    def flops(recompute: RecomputeMode, old: bool = False, ref: bool = False) -> int:
        return flops_per_token_param(recompute, old_policy_forward=old, reference_forward=ref)

    assert flops(RecomputeMode.none) == flops(RecomputeMode.selective) == 6  # forward 2, backward 4
    assert flops(RecomputeMode.full) == 8  # + the forward recompute repeats
    assert flops(RecomputeMode.full, old=True) == 10  # + an old-policy forward (updates_per_step > 1)
    assert flops(RecomputeMode.full, old=True, ref=True) == 12  # + the KL reference model's forward
    assert train_seconds(1e18, gpus=10, peak_tflops=1000.0, mfu=0.5) == pytest.approx(200.0)
    assert step_seconds(100.0, 20.0, 5.0, overlap=False) == 125.0
    assert step_seconds(100.0, 20.0, 5.0, overlap=True) == 105.0
    assert step_seconds(10.0, 20.0, 5.0, overlap=True) == 25.0


def test_dapo_math_by_hand(dapo: Config) -> None:
    """32 x 8 samples, 0.75 x 4096 = 3072 tokens each, 2 engines at 4000 tok/s; 200-token prompts;
    8 FLOP (full recompute, one update: no old-policy forward) x 13 B active on 16 MI355X (2516.6
    TFLOP/s) at MFU 0.2; 285.1 GB over 50 GB/s."""
    est = step_time(dapo)
    assert est is not None
    assert est.generated_tokens == 786_432 and est.trained_tokens == 786_432 + 256 * 200
    assert est.rollout_s == pytest.approx(786_432 / (2 * 4000))  # 98.3 s
    assert est.train_flops == pytest.approx(8 * 13e9 * 837_632)  # 8.71e16
    assert est.train_s == pytest.approx(8.7113728e16 / (16 * 2516.6e12 * 0.2))  # 10.8 s
    assert est.sync_bytes == pytest.approx(FP8_ROLLOUT_BYTES)
    assert est.sync_s == pytest.approx(FP8_ROLLOUT_BYTES / 50e9)  # 5.7 s
    assert est.step_s == pytest.approx(98.304 + 10.8174 + 5.7026, abs=1e-3)  # 114.8 s
    assert est.step_async_s == pytest.approx(98.304 + 5.7026, abs=1e-3)  # 104.0 s
    assert est.assumptions["sync_link"] == "between nodes (cluster.network_gb_per_s)"


def test_every_assumption_is_read(dapo: Config) -> None:
    base = step_time(dapo)
    assert base is not None
    dapo.estimate.engine_tokens_per_s = 8000.0
    dapo.estimate.mfu = 0.4
    dapo.estimate.response_len_fraction = 0.5
    dapo.estimate.mean_prompt_tokens = 0.0
    dapo.quant.name = QuantMode.fp8_mxfp4
    dapo.cluster.network_gb_per_s = 25.0
    est = step_time(dapo)
    assert est is not None
    assert est.rollout_s == pytest.approx(32 * 8 * 2048 / (2 * 8000))  # 32.8 s
    assert est.train_s == pytest.approx(8 * 13e9 * 32 * 8 * 2048 / (16 * 2516.6e12 * 0.4))
    assert est.sync_s == pytest.approx(MXFP4_BYTES / 25e9)
    assert est.assumptions["mfu"] == 0.4 and est.assumptions["engine_tokens_per_s"] == 8000.0
    dapo.algo.updates_per_step, dapo.algo.kl_coef = 2, 0.01  # old-policy and reference forwards
    assert step_time(dapo).flops_per_token_param == 12  # type: ignore[union-attr]


def test_one_node_syncs_over_the_devices_links(dapo: Config) -> None:
    dapo.cluster.nnodes = 1
    est = step_time(dapo)
    assert est is not None
    assert est.sync_s == pytest.approx(FP8_ROLLOUT_BYTES / 537.6e9)  # MI355X XGMI, one way
    dapo.cluster.nnodes, dapo.cluster.network_gb_per_s = 4, None
    assert step_time(dapo).assumptions["sync_link"] == "between nodes (400 Gb/s NIC)"  # type: ignore[union-attr]


def test_colocated_steps_do_not_overlap(dapo: Config) -> None:
    dapo.parallel.colocate = True
    est = step_time(dapo)
    assert est is not None and est.step_async_s == est.step_s


def test_cpu_has_no_estimate() -> None:
    tiny = compose("tiny_arith")
    assert step_time(tiny) is None
    assert step_time_json(tiny) == {"estimated": False, "reason": "not estimated on CPU (cluster.device=cpu)"}


def test_plan_prints_the_estimate_with_its_assumptions() -> None:
    result = CliRunner().invoke(app, ["plan", "recipe=dapo_math", "--node-rank", "0", "--skip-engine-check"])
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "step time (estimate): rollout 98.3 s + train 10.8 s + sync 5.7 s = 114.8 s" in out
    assert "async, one step off-policy: 104.0 s" in out
    for key in (
        "estimate.engine_tokens_per_s 4000",
        "estimate.mfu 0.2",
        "estimate.response_len_fraction 0.75",
    ):
        assert key in out
