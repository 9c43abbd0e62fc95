"""Smoke tests of the benchmarks: `--quick` runs finish and write the JSON the README describes."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "weight_sync.py"
QUANT_BENCH = BENCH.with_name("quant_sync.py")
LOOP_BENCH = BENCH.with_name("loop_overhead.py")


def run_quick(bench: Path, out: Path, timeout: float, *extra: str) -> subprocess.CompletedProcess:
    """`python bench/<name>.py --quick --out OUT`; fails the test with the bench's output when it fails."""
    proc = subprocess.run(
        [sys.executable, str(bench), "--quick", "--out", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_weight_sync_bench_quick(tmp_path: Path) -> None:
    out = tmp_path / "weight_sync.json"
    proc = run_quick(BENCH, out, timeout=40)
    result = json.loads(out.read_text())

    meta = result["meta"]
    for key in ("timestamp", "torch", "cpu_count", "git_commit", "mode"):
        assert key in meta
    assert meta["mode"] == "quick"
    assert result["memcpy"]["bytes"] > 0 and result["memcpy"]["gb_per_s"] > 0

    syncs = result["syncs"]
    combos = {(s["set"], s["format"]) for s in syncs}
    assert combos == {(n, f) for n in ("tiny", "synthetic") for f in ("per_tensor", "flattened_bucket")}
    assert {s["bucket_bytes"] for s in syncs if s["set"] == "synthetic"} >= {1 << 30}
    for s in syncs:
        assert s["bytes"] > 0 and s["buckets"] >= 1 and s["tensors"] >= 1
        assert s["gb_per_s"] > 0 and s["transfer_gb_per_s"] > 0
        assert 0 < s["transfer_seconds"] <= s["seconds"]
        assert s["ratio_vs_memcpy"] == pytest.approx(s["gb_per_s"] / result["memcpy"]["gb_per_s"])
        assert s["ratio_vs_1gib"] > 0
    # the small-bucket runs really split the synthetic set
    assert max(s["buckets"] for s in syncs if s["set"] == "synthetic") > 1
    assert "memcpy" in proc.stdout and "GB/s" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_quant_sync_bench_quick(tmp_path: Path) -> None:
    out = tmp_path / "quant_sync.json"
    proc = run_quick(QUANT_BENCH, out, timeout=100)
    result = json.loads(out.read_text())
    assert result["meta"]["mode"] == "quick" and result["memcpy"]["gb_per_s"] > 0
    raw = result["raw_broadcast"]
    assert raw["bytes"] == 64 << 20 and raw["gb_per_s"] > 0
    variants = {s["variant"]: s for s in result["syncs"]}
    assert set(variants) == {"bucketed", "bucketed_flattened", "per_tensor", "bucketed_fp8_mxfp4"}
    assert variants["bucketed"]["bytes"] == raw["bytes"] and variants["bucketed"]["buckets"] == 4
    assert variants["per_tensor"]["buckets"] > 50  # one request per tensor (fused pairs share one)
    assert variants["bucketed_fp8_mxfp4"]["bytes"] < raw["bytes"] / 3  # quantized on the wire
    assert [q["mode"] for q in result["quantization"]] == ["bf16", "fp8_rollout", "fp8_mxfp4"]
    ratios = result["ratios"]
    assert ratios["bucketed_vs_raw_broadcast"] == pytest.approx(
        variants["bucketed"]["gb_per_s"] / raw["gb_per_s"]
    )
    assert "bucketed_vs_raw_broadcast" in proc.stdout and "quantize on send" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_loop_overhead_bench_quick(tmp_path: Path) -> None:
    """The floor's three parts, measured before, between and after a 4-step run and a 4-step async run;
    each ratio computed from the numbers of the same bench run."""
    out = tmp_path / "loop_overhead.json"
    proc = run_quick(LOOP_BENCH, out, 580, "--steps", "4")
    result = json.loads(out.read_text())
    floor, ours, ratios = result["floor"], result["dsv4rl"], result["ratios"]
    assert floor["generate"]["samples"] == 512 and floor["train"]["sequences"] == 512
    for part in ("generate", "train", "broadcast"):
        runs = floor[part]["runs_seconds"]
        assert len(runs) == 3 and floor[part]["seconds"] == pytest.approx(statistics.median(runs))
    assert floor["seconds"] == pytest.approx(
        sum(floor[p]["seconds"] for p in ("generate", "train", "broadcast"))
    )
    assert ours["steps"] == 4 and ours["step_s"] > 0 and ours["wall_s"] > ours["step_s"]
    assert ratios["step_vs_floor"] == pytest.approx(ours["step_s"] / floor["seconds"])
    assert ratios["sync_vs_broadcast"] == pytest.approx(ours["sync_s"] / floor["broadcast"]["seconds"])
    assert "algo.async_rollout=true" in result["dsv4rl_async"]["overrides"]
    assert ratios["async_step_vs_floor"] == pytest.approx(result["dsv4rl_async"]["step_s"] / floor["seconds"])
    assert "step_vs_floor" in proc.stdout and "async step" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_reward_overlap_bench_quick(tmp_path: Path) -> None:
    """The overlap part only (the demo part is two training runs): a step with a 50 ms reward in 2 workers
    takes less than generation plus the serial reward."""
    out = tmp_path / "reward_overlap.json"
    run_quick(BENCH.with_name("reward_overlap.py"), out, 150, "--no-demo")
    result = json.loads(out.read_text())
    overlap = result["overlap"]
    assert overlap["median"]["samples"] == 64 and overlap["num_workers"] == 2
    assert overlap["median"]["serial_reward_s"] >= 64 * 0.05
    assert result["demo"] is None and result["meta"]["bench"] == "reward_overlap"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_async_long_tail_bench_quick(tmp_path: Path) -> None:
    """Six steps of K=0 and of K=2 with partial rollouts on the long-tailed task: each run's figures come
    from its own metrics, each ratio from the two runs of the same bench run."""
    out = tmp_path / "async_long_tail.json"
    proc = run_quick(BENCH.with_name("async_long_tail.py"), out, 280)
    runs = json.loads(out.read_text())["runs"]
    assert list(runs) == ["K=0", "K=2 partial"]
    k0, k2 = runs["K=0"], runs["K=2 partial"]
    assert k0["steps"] == k2["steps"] == 6 and k0["staleness_max"] == 0 and 0 < k2["staleness_max"] <= 2
    assert k0["truncated_fraction"] > 0.1  # a tail at the 32-token cap
    assert k2["samples_per_s_vs_k0"] == pytest.approx(k2["samples_per_s"] / k0["samples_per_s"])
    assert "sync.pause_mode=in_place" in k2["overrides"] and "K=2 partial" in proc.stdout
