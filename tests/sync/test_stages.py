"""Several weight-sync sources: two trainer ranks (two pipeline stages) send their halves of a model to
real reference engines at the same time, each over its own group, inside one session rank 0 opens."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest
import torch
import torch.distributed as dist
from sync_helpers import HERE, TRAINER_SEED, trainer_model, wire_tensors
from test_weight_sync import assert_engine_holds, engine_checksums, version_of

from dsv4rl.sync.stages import StagedWeightSync, StoreLock, merge_stats
from dsv4rl.sync.weight_sync import SyncStats, WeightSyncError
from dsv4rl.topology import SyncSource
from dsv4rl.wire.checksum import checksums
from free_ports import free_port


def run_stages(out, urls: list[str], *flags: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(free_port()), str(HERE / "_staged_trainer.py"),
        str(out), str(free_port()), str(free_port()), *urls, *flags,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=180, env=env)


def test_two_stages_reach_two_engines(engine_urls: list[str], tmp_path) -> None:
    result = run_stages(tmp_path, engine_urls)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    stats = json.loads((tmp_path / "stats.json").read_text())
    model = trainer_model(TRAINER_SEED + 5)
    expected = checksums(wire_tensors(model))
    assert stats["sources"] == 2 and stats["tensors"] == len(expected)
    assert stats["checksums"] == expected  # both stages' checksums gathered on rank 0
    for url in engine_urls:
        assert version_of(url) == "v-staged"  # set once, after both stages arrived
        assert_engine_holds(url, model)


def test_a_refused_stage_stops_every_rank_and_closes_the_session(engine_urls: list[str], tmp_path) -> None:
    before = engine_checksums(engine_urls[0])
    result = run_stages(tmp_path, engine_urls, "--bad-stage-1")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    errors = [(tmp_path / f"error-rank{rank}.txt").read_text() for rank in (0, 1)]
    assert errors[0] == errors[1]  # every rank raises the same error, naming the stage that failed
    assert "stage 1 (rank 1)" in errors[0] and "not_a_tensor" in errors[0]
    assert not (tmp_path / "stats.json").exists()
    for url in engine_urls:
        # rank 0 closed the session: a new one opens; the engines stay paused until a good push
        begin = httpx.post(f"{url}/begin_weight_update", json={}, timeout=10).json()
        assert begin["success"], begin
        httpx.post(f"{url}/end_weight_update", json={}, timeout=10)
        httpx.post(f"{url}/continue_generation", json={}, timeout=10)
    assert engine_checksums(engine_urls[0]).keys() == before.keys()


def test_merged_stats_add_sizes_and_transfers_and_take_the_slowest_preparation() -> None:
    first = SyncStats(bytes=10, buckets=2, tensors=5, transfer_seconds=1.0, pipeline_seconds=0.5)
    first.checksums = {"a": "1"}
    second = SyncStats(bytes=7, buckets=1, tensors=3, transfer_seconds=2.0, pipeline_seconds=0.1)
    second.checksums = {"b": "2"}
    merged = merge_stats([first, second])
    assert (merged.bytes, merged.buckets, merged.tensors, merged.sources) == (17, 3, 8, 2)
    assert (merged.transfer_seconds, merged.pipeline_seconds) == (3.0, 0.5)
    assert merged.checksums == {"a": "1", "b": "2"}


def test_rank_0_must_send_stage_0_and_sources_need_senders() -> None:
    sources = [SyncSource(0, 0, 0, "h", 1, "g"), SyncSource(1, 4, 0, "h", 2, "g-pp1")]
    with pytest.raises(ValueError, match="stage 0's weights must leave from rank 0"):
        StagedWeightSync(sources[1:], 4, object())
    with pytest.raises(ValueError, match="rank 4 is a stage source but got sender=None"):
        StagedWeightSync(sources, 4, None)
    with pytest.raises(ValueError, match="rank 2 is no stage source"):
        StagedWeightSync(sources, 2, object())
    single = StagedWeightSync(sources[:1], 3, None)
    assert not single.by_stage and single.stage is None
    assert single.push(iter([("x", torch.zeros(1))]), "v") is None  # drains: other ranks only gather


def test_store_lock_lets_one_sender_at_a_time_and_names_the_holder() -> None:
    store = dist.HashStore()
    first = StoreLock(store, "engines", "stage 0 (rank 0)", timeout_s=5)
    second = StoreLock(store, "engines", "stage 1 (rank 4)", timeout_s=0.05)
    held = r"stage 1 \(rank 4\) waited .* held by stage 0 \(rank 0\)"
    with first, pytest.raises(WeightSyncError, match=held):
        second.__enter__()
    with second:  # released: the other sender's turn
        assert store.get("engines") == b"stage 1 (rank 4)"
    assert store.get("engines") == b""
