"""End to end: `dsv4rl align --attribute --json` against the reference engine computing as SGLang does, as
a user runs it (the issue's acceptance command, with fewer prompts)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from free_ports import port_overrides

pytestmark = pytest.mark.slow


def test_attribute_closes_the_gap_and_names_each_features_share(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "dsv4rl.cli", "align", "recipe=tiny_arith", "engine.numerics=sglang",
            f"run.dir={tmp_path}", "align.prompts=8", *port_overrides(), "--attribute", "--json"]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)
    baseline, aligned = report["baseline"], report["aligned"]
    for row in (baseline, aligned):
        assert {"mean_abs_diff", "p99_abs_diff", "max_abs_diff", "tokens"} <= set(row)
    assert baseline["tokens"] == aligned["tokens"] == 8 * 4  # one fixed set of one-token responses
    assert baseline["mean_abs_diff"] > 1e-4  # SGLang's emulated rounding against a float32 trainer
    assert aligned["mean_abs_diff"] * 5 <= baseline["mean_abs_diff"]
    assert aligned["p99_abs_diff"] * 3 <= baseline["p99_abs_diff"]
    names = [row["name"] for row in report["features"]]
    assert {"routing_replay", "fp32_lm_head", "kv_fp8", "bf16_weights", "bf16_activations"} <= set(names)
    assert "act_fp8" in report["skipped_features"]  # quant=none: no FP8 linears
    for row in report["features"]:
        assert {"name", "mean_abs_diff_alone", "mean_abs_diff_without"} <= set(row)
    kv = next(row for row in report["features"] if row["name"] == "kv_fp8")
    assert kv["mean_abs_diff_alone"] < baseline["mean_abs_diff"]  # the FP8 cache is the largest share
    assert report["engine_starts"] == 2  # the fp32 LM head is an engine flag; the rest act in the trainer
    run_dir = tmp_path / "align" / "none" / "attribute"
    names = ("attribute-none.json", "attribute-fp32_lm_head.json")  # one report per engine start
    engines = [json.loads((run_dir / name).read_text()) for name in names]
    assert engines[0]["sequences"] == engines[1]["sequences"] == 32
    assert (run_dir / "attribute_sequences.json").is_file()
    assert json.loads((run_dir / "attribute.json").read_text()) == report
