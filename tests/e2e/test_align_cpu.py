"""End to end: `dsv4rl align` through the reference engine, for every quant mode, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_train_cpu import port_overrides

pytestmark = pytest.mark.slow

KEYS = ("mean_abs_diff", "p50_abs_diff", "p95_abs_diff", "p99_abs_diff", "max_abs_diff", "tokens", "quant")


def align(run_dir: Path, quant: str) -> dict:
    argv = [sys.executable, "-m", "dsv4rl.cli", "align", "recipe=tiny_arith", f"quant={quant}",
            f"run.dir={run_dir}", "align.prompts=16", *port_overrides(), "--json"]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(result.stdout)  # nothing else on stdout: the progress goes to stderr


def test_align_in_every_quant_mode(tmp_path: Path) -> None:
    reports = {quant: align(tmp_path, quant) for quant in ("none", "bf16", "fp8_rollout", "fp8_mxfp4")}
    for quant, report in reports.items():
        assert all(key in report for key in KEYS) and report["quant"] == quant
        assert report["tokens"] == 16 * 4 * report["max_new_tokens"]
        assert (
            report["p50_abs_diff"]
            <= report["p95_abs_diff"]
            <= report["p99_abs_diff"]
            <= report["max_abs_diff"]
        )
        assert (
            len(report["worst_tokens"]) == 10
            and report["worst_tokens"][0]["abs_diff"] == report["max_abs_diff"]
        )
        assert (tmp_path / "align" / quant / "align.json").is_file()
    assert reports["none"]["mean_abs_diff"] < 1e-4  # fp32 on both sides
    for quant in ("bf16", "fp8_rollout", "fp8_mxfp4"):
        assert 1e-5 < reports[quant]["mean_abs_diff"] < 0.09, (quant, reports[quant]["mean_abs_diff"])
    # coarser formats, larger differences
    assert reports["bf16"]["mean_abs_diff"] < reports["fp8_rollout"]["mean_abs_diff"]
