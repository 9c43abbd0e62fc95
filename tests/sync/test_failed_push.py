"""A push that fails midway on engines whose weight post-processing is not idempotent (SGLang on ROCm,
emulated by the reference engine's `--emulate-non-idempotent-postprocess`): the sync stops for good with
the restart message, never closes the session (closing re-lays out every module not re-sent), and the
engine never serves those weights again."""

from __future__ import annotations

import httpx
import pytest
import torch
from sync_helpers import TRAINER_SEED, trainer_model, wire_tensors
from test_weight_sync import assert_engine_holds, engine_checksums, make_sync

from dsv4rl.model.naming import CheckpointKind, checkpoint_kind
from dsv4rl.sync.weight_sync import WeightSyncError
from dsv4rl.wire.checksum import checksums

WHY = "aiter re-shuffles MoE weights in place (test)"


def with_a_bad_tensor(model: torch.nn.Module, after: int) -> list[tuple[str, torch.Tensor]]:
    """The model's weights with a tensor the engine refuses (wrong shape) after `after` good ones, so the
    buckets before it are written and the rest are not."""
    items = list(model.state_dict().items())
    return [*items[:after], ("model.norm.weight", torch.zeros(65)), *items[after:]]


def generate_status(url: str) -> tuple[int, str]:
    response = httpx.post(
        f"{url}/generate",
        json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}},
        timeout=30,
    )
    return response.status_code, response.text


def relaid_out(name: str) -> bool:
    return checkpoint_kind(name) in (CheckpointKind.routed_expert, CheckpointKind.fp8_linear)


def test_a_failed_push_stops_for_good_and_the_engine_is_not_served(emulating_engine: str) -> None:
    url = emulating_engine
    first, second = trainer_model(TRAINER_SEED + 30), trainer_model(TRAINER_SEED + 31)
    sync = make_sync(url, bucket_bytes=8 * 1024, pause=False, non_idempotent=WHY)
    try:
        sync.connect()
        sync.push(first.state_dict().items(), "v1")  # complete: every module re-sent, nothing corrupted
        assert_engine_holds(url, first)
        assert generate_status(url)[0] == 200

        with pytest.raises(WeightSyncError) as failed:
            sync.push(with_a_bad_tensor(second, after=10), "v2")
        message = str(failed.value)
        assert "float32 [65]" in message  # what failed
        assert WHY in message and "restart the engines" in message and "resume=auto" in message
        assert sync.spent and "never push to these engines again" in sync.spent
        # No retry on these engines, whatever the caller does: not after close() and connect() either.
        with pytest.raises(WeightSyncError, match="restart the engines"):
            sync.push(first.state_dict().items(), "v3")
        sync.close()
        with pytest.raises(WeightSyncError, match="restart the engines"):
            sync.connect()
    finally:
        sync.close()

    # The session was left open: the engine's weights are the partial update, nothing re-laid out ...
    held = engine_checksums(url)
    old, new = checksums(wire_tensors(first)), checksums(wire_tensors(second))
    assert all(held[name] in (old[name], new[name]) for name in held)
    assert any(held[name] == new[name] != old[name] for name in held)  # the buckets before the failure
    assert any(held[name] == old[name] != new[name] for name in held)  # the rest, as they were
    # ... and the engine never serves them: no generate, an unhealthy engine, no new session.
    status, text = generate_status(url)
    assert status == 400 and "partly updated" in text and "restart the engine" in text
    assert httpx.get(f"{url}/health_generate", timeout=30).status_code == 503
    begin = httpx.post(f"{url}/begin_weight_update", json={}, timeout=10).json()
    assert begin["success"] is False


def test_closing_the_session_re_lays_out_what_was_not_re_sent(emulating_engine: str) -> None:
    """What closing the session would do (the old abandon, right only for idempotent engines): the
    emulated post-processing corrupts every routed-expert and FP8-linear weight the failed push did not
    re-send, as SGLang's aiter re-shuffle on ROCm does; the engine is then spent too."""
    url = emulating_engine
    first, second = trainer_model(TRAINER_SEED + 32), trainer_model(TRAINER_SEED + 33)
    sync = make_sync(url, bucket_bytes=8 * 1024, pause=False)  # treated as idempotent: closes the session
    try:
        sync.connect()
        sync.push(first.state_dict().items(), "v1")
        with pytest.raises(WeightSyncError, match=r"float32 \[65\]"):
            sync.push(with_a_bad_tensor(second, after=10), "v2")
        assert sync.spent is None
    finally:
        sync.close()
    held = engine_checksums(url)
    old, new = checksums(wire_tensors(first)), checksums(wire_tensors(second))
    corrupt = [name for name in held if held[name] not in (old[name], new[name])]
    assert corrupt and all(relaid_out(name) for name in corrupt)
    status, text = generate_status(url)
    assert status == 400 and "did not re-send" in text and "restart the engine" in text


def test_a_complete_push_and_an_empty_session_on_a_fresh_engine(emulating_engine: str) -> None:
    """Complete pushes leave nothing to re-lay out, push after push; a session that re-sends nothing
    re-lays out everything (SGLang post-processes every module at every close)."""
    url = emulating_engine
    sync = make_sync(url, bucket_bytes=64 * 1024, pause=False, non_idempotent=WHY)
    try:
        sync.connect()
        for seed in (34, 35):
            model = trainer_model(TRAINER_SEED + seed)
            sync.push(model.state_dict().items(), f"v{seed}")
            assert_engine_holds(url, model)
    finally:
        sync.close()
    assert httpx.post(f"{url}/begin_weight_update", json={}, timeout=10).status_code == 200
    assert httpx.post(f"{url}/end_weight_update", json={}, timeout=10).status_code == 200
    status, text = generate_status(url)
    assert status == 400 and "did not re-send" in text
