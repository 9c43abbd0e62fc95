"""End to end: `dsv4rl align` through the reference engine, for every quant mode, as a user runs it."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from free_ports import port_overrides

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]

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
    gpu_check_reads_the_reports(tmp_path / "gpu_check", reports)


def gpu_check_reads_the_reports(out: Path, reports: dict[str, dict]) -> None:
    """launch/gpu_check.sh judges a push on what `dsv4rl align --json` printed: these honest pushes into the
    reference engine pass, each figure read from the report and shown beside its bound."""
    spec = importlib.util.spec_from_file_location(
        "gpu_check_summary", ROOT / "launch" / "gpu_check_summary.py"
    )
    summary = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summary)
    (out / "trainer").mkdir(parents=True)
    trainer = {"ok": True, **{key: {"ok": True} for key in summary.TRAINER_CHECKS}}
    (out / "trainer" / "trainer.json").write_text(json.dumps(trainer))
    (out / "trainer.rc").write_text("0\n")
    for quant, report in reports.items():
        (out / f"colocated_push.{quant}.json").write_text(json.dumps(report, indent=2))
        (out / f"colocated_push.{quant}.rc").write_text("0\n")
    argv = ["summary", str(out), "--gpus", "1", "--device", "cpu", "--cluster-device", "cpu",
            "--comm", "cpu_gloo", "--shape", "tiny", "--sglang", "-", "--engines", "1",
            "--formats", *reports]  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()) as stdout, contextlib.redirect_stderr(io.StringIO()):
        code = summary.main(argv)
    result = json.loads(stdout.getvalue())
    assert code == 0 and result["ok"], result
    for check in result["checks"][1:]:
        report = reports[check["format"]]
        assert check["status"] == "passed" and check["bounds"] == summary.LOGPROB_BOUNDS[check["format"]]
        assert (check["figures"]["logprob_mean_abs_diff"], check["figures"]["logprob_max_abs_diff"]) == (
            report["mean_abs_diff"],
            report["max_abs_diff"],
        )
