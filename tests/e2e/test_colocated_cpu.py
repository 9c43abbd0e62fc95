"""End to end, colocated: `dsv4rl train recipe=tiny_arith parallel.colocate=true` learns like the
disaggregated run, with every sync by tensor handles (/update_weights_from_tensor) and the engine's memory
released for training and taken back in slime's order, each sync verified bit for bit (checksums)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4rl.metrics import read_metrics
from free_ports import port_overrides

pytestmark = pytest.mark.slow


def test_colocated_tiny_arith_learns(tmp_path: Path) -> None:
    run_dir = tmp_path / "colocated"
    argv = [sys.executable, "-m", "dsv4rl.cli", "train", "recipe=tiny_arith", f"run.dir={run_dir}",
            "run.progress=false", *port_overrides(),
            "parallel.colocate=true", "train.steps=30"]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{' '.join(argv)}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    metrics = read_metrics(run_dir / "metrics.jsonl")
    rewards = [line["reward_mean"] for line in metrics]
    # 30 steps (cosine over 30): the fp32 disaggregated run goes from 0.05 (steps 1-5) to 0.29 (last ten)
    first, last = sum(rewards[:5]) / 5, sum(rewards[-10:]) / 10
    assert len(metrics) == 30 and last >= 0.15 and last >= 2.5 * first, rewards
    assert all(line["sync_transport"] == "tensor" and line["sync_bytes"] > 0 for line in metrics)
    assert all(line["time_offload_s"] > 0 for line in metrics)
    # the verified syncs (sync.verify.every_steps): the engine holds exactly what was sent (checksums of
    # every tensor) and scores the probe like the trainer; fp32 on both sides, so rollouts do too
    checked = [line for line in metrics if "verify_checksum_tensors" in line]
    assert len(checked) >= 3 and all(line["verify_checksum_tensors"] > 150 for line in checked)
    assert max(line["verify_probe_abs_diff"] for line in checked) < 1e-4
    assert max(line["logprob_abs_diff"] for line in metrics) < 1e-4
    log = (run_dir / "logs" / "engine-0.log").read_text()
    assert "--enable-memory-saver" in log
    calls = re.findall(r"memory (released|resumed): ([a-z_, ]+)", log)
    cycle = [("released", "kv_cache, weights, cuda_graph"), ("resumed", "weights"),
             ("resumed", "kv_cache, cuda_graph")]  # fmt: skip
    assert calls == cycle * 30
