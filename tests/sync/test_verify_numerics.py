"""The log-prob probe's bound with an engine that rounds as SGLang does (`engine.numerics=sglang`)."""

from __future__ import annotations

import asyncio

from dsv4rl.config.choices import EngineNumerics, QuantMode
from dsv4rl.config.schema import SyncVerifyConfig
from dsv4rl.sync.verify import PROBE_BOUNDS, SGLANG_NUMERICS_BOUND, SyncVerifier


def test_sglang_numerics_widen_the_bound_to_an_fp8_checkpoints() -> None:
    loop = asyncio.new_event_loop()
    try:
        exact = SyncVerifier([], SyncVerifyConfig(), QuantMode.none, loop)
        sglang = SyncVerifier([], SyncVerifyConfig(), QuantMode.none, loop, EngineNumerics.sglang)
        fp8 = SyncVerifier([], SyncVerifyConfig(), QuantMode.fp8_mxfp4, loop, EngineNumerics.sglang)
        chosen = SyncVerifier(
            [], SyncVerifyConfig(max_mean_abs_diff=0.5), QuantMode.none, loop, EngineNumerics.sglang
        )
    finally:
        loop.close()
    assert exact.bound == PROBE_BOUNDS[QuantMode.none] < sglang.bound == SGLANG_NUMERICS_BOUND
    assert fp8.bound == PROBE_BOUNDS[QuantMode.fp8_mxfp4]
    assert chosen.bound == 0.5  # the recipe's own bound wins
