"""`dsv4rl report`: plots and report.md from a recorded tiny_arith run, a stopped run with eval, errors."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dsv4rl.cli import app
from dsv4rl.faults.run_outcome import RunOutcome, write_run_outcome
from dsv4rl.report import build_report
from dsv4rl.report.build import planned_steps
from dsv4rl.report.metrics_table import MetricsTable, parse_metrics_text
from dsv4rl.report.plots import TOPICS, render_plots
from dsv4rl.report.summary import run_status

RECORDED = Path(__file__).parent / "data" / "metrics_tiny_arith.jsonl"
PLOTS_WITHOUT_EVAL = ["reward", "response_length", "logprob_diff", "kl_entropy", "step_time", "sync"]
runner = CliRunner()


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG's IHDR chunk; fails on anything that is not a PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def make_run(
    root: Path, rows: list[dict] | None = None, steps_planned: int | None = 12, tail: str = ""
) -> Path:
    run_dir = root / "run"
    run_dir.mkdir()
    if rows is None:
        shutil.copy(RECORDED, run_dir / "metrics.jsonl")
    else:
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    if tail:
        with (run_dir / "metrics.jsonl").open("a") as handle:
            handle.write(tail)
    if steps_planned is not None:
        (run_dir / "config.yaml").write_text(f"recipe: tiny_arith\ntrain:\n  steps: {steps_planned}\n")
    return run_dir


def recorded_rows() -> list[dict]:
    return [json.loads(line) for line in RECORDED.read_text().splitlines()]


@pytest.fixture(scope="module")
def recorded_report(tmp_path_factory: pytest.TempPathFactory):
    return build_report(make_run(tmp_path_factory.mktemp("recorded")))


def test_recorded_run_gets_one_png_per_topic_but_eval(recorded_report) -> None:
    out = recorded_report.out_dir
    assert out.name == "report" and out.parent.name == "run"
    assert list(recorded_report.plots.written) == PLOTS_WITHOUT_EVAL
    for name in PLOTS_WITHOUT_EVAL:
        path = out / f"{name}.png"
        assert path.stat().st_size > 8_000, name
        width, height = png_size(path)
        assert width >= 600 and height >= 300
    assert not (out / "eval.png").exists()
    assert set(recorded_report.plots.skipped) == {"eval"}


def test_summary_numbers_come_from_the_metrics_file(recorded_report) -> None:
    rows = recorded_rows()
    rewards = [row["reward_mean"] for row in rows]
    text = recorded_report.summary.read_text()
    best = max(range(12), key=rewards.__getitem__)
    assert f"`{recorded_report.table.path}`, 12 steps found (1..12)" in text
    assert "status: **finished** (step 12 of 12 reached)" in text
    assert f"| first | 1 | {rewards[0]:.4g} |" in text
    assert f"| last | 12 | {rewards[-1]:.4g} |" in text
    assert f"| best | {best + 1} | {rewards[best]:.4g} |" in text
    assert f"| mean of the first 10 | 1..10 | {sum(rewards[:10]) / 10:.4g} |" in text
    assert f"| mean of the last 10 | 3..12 | {sum(rewards[-10:]) / 10:.4g} |" in text
    step_mean = sum(row["time_step_s"] for row in rows) / 12
    train_mean = sum(row["time_train_s"] for row in rows) / 12
    recent = sum(row["time_step_s"] for row in rows[-10:]) / 10  # the pace: the last 10 steps
    said = f"{1 / recent:.3g} steps/s" if recent <= 1 else f"{recent:.3g} s/step"
    assert f"Mean step time: **{step_mean:.4g} s** over 12 steps ({said} over the last 10)." in text
    assert f"| train | {train_mean:.4g} | {100 * train_mean / step_mean:.1f}% |" in text
    gb_per_s = [row["sync_gb_per_s"] for row in rows]
    assert (
        f"| throughput (GB/s) | {sum(gb_per_s) / 12:.4g} | {min(gb_per_s):.4g} | {max(gb_per_s):.4g} |"
        in text
    )
    for name in PLOTS_WITHOUT_EVAL:
        assert f"![{name}]({name}.png)" in text
    assert "- `eval`: no eval/... keys in the metrics" in text
    assert "## Evaluation" not in text and "Lines skipped" not in text


def test_stopped_run_with_eval_on_some_steps(tmp_path: Path) -> None:
    rows = recorded_rows()[:8]
    for step, score in ((4, 0.25), (8, 0.5)):
        rows[step - 1] |= {"eval/pass@1": score, "eval/pass@8": score + 0.25, "eval/response_len_mean": 30.0}
    run_dir = make_run(tmp_path, rows, steps_planned=20)
    hours_ago = time.time() - 3 * 3600
    os.utime(run_dir / "metrics.jsonl", (hours_ago, hours_ago))
    report = build_report(run_dir, tmp_path / "elsewhere")
    assert report.out_dir == tmp_path / "elsewhere" and not (run_dir / "report").exists()
    assert png_size(report.out_dir / "eval.png")[0] >= 600 and report.plots.skipped == {}
    text = report.summary.read_text()
    assert "8 steps found (1..8)" in text
    assert "status: **stopped** (at step 8 of 20; metrics last written 3.0 h ago)" in text
    assert "| eval/pass@1 | 2 | 0.25 (step 4) | 0.5 (step 8) | 0.5 (step 8) |" in text
    assert "| eval/pass@8 | 2 | 0.5 (step 4) | 0.75 (step 8) | 0.75 (step 8) |" in text
    assert "![eval](eval.png)" in text


def test_eval_plot_appears_only_with_eval_keys_and_a_stale_one_is_removed(tmp_path: Path) -> None:
    eval_topic = tuple(topic for topic in TOPICS if topic.name == "eval")
    with_eval = MetricsTable(
        Path("m.jsonl"), [{"step": 1}, {"step": 2, "eval/avg@8": 0.4, "eval/maj@8": 0.6}]
    )
    assert render_plots(with_eval, tmp_path, eval_topic).written == {"eval": tmp_path / "eval.png"}
    png_size(tmp_path / "eval.png")
    without = MetricsTable(Path("m.jsonl"), [{"step": 1, "reward_mean": 0.1}])
    result = render_plots(without, tmp_path, eval_topic)
    assert result.written == {} and "no eval/... keys" in result.skipped["eval"]
    assert not (tmp_path / "eval.png").exists()


def test_cli_reports_a_run_in_progress_with_a_partial_last_line(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, recorded_rows()[:5], tail='{"step": 6, "reward_mean": 0.1')
    result = runner.invoke(app, ["report", str(run_dir), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "warning: metrics.jsonl line 6 skipped: partial last line" in result.output
    assert "5 steps (1..5), run in progress" in result.output
    assert "reward.png" in result.output and "report.md" in result.output
    text = (tmp_path / "out" / "report.md").read_text()
    assert "status: **in progress** (at step 5 of 12;" in text
    assert "- line 6 skipped: partial last line" in text


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda root: root / "missing", "does not exist"),
        (lambda root: root, "has no metrics.jsonl"),
        (lambda root: (root / "metrics.jsonl").write_text("\n\n") and root, "has no complete step line"),
    ],
)
def test_cli_errors_exit_2_with_one_message(tmp_path: Path, setup, message: str) -> None:
    result = runner.invoke(app, ["report", str(setup(tmp_path))])
    assert result.exit_code == 2
    assert result.output.startswith("error: ") and message in result.output
    assert "Traceback" not in result.output


def test_run_status_from_planned_steps_and_idle_time() -> None:
    table = parse_metrics_text(RECORDED.read_text(), RECORDED)
    assert run_status(table, 12, idle_s=10_000).state == "finished"
    assert run_status(table, 30, idle_s=20).state == "in progress"
    stopped = run_status(table, 30, idle_s=10_000)
    assert (stopped.state, stopped.detail) == ("stopped", "at step 12 of 30; metrics last written 2.8 h ago")
    assert run_status(table, None, idle_s=10_000).state == "finished or stopped"
    assert run_status(table, None, idle_s=20).state == "in progress"


def test_a_crashed_run_says_so_with_its_root_cause_not_in_progress(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, recorded_rows()[:5])  # written just now: in progress by the file alone
    cause = "trainer: ValueError: [bad] row (at src/dsv4rl/train/loop.py:12 in step)"
    write_run_outcome(run_dir, RunOutcome("failed", 5, 1, cause))
    result = runner.invoke(app, ["report", str(run_dir), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert f"5 steps (1..5), run crashed at step 5 (root cause: {cause})" in result.output  # markup kept
    text = (tmp_path / "out" / "report.md").read_text()
    assert f"status: **crashed** at step 5 (root cause: {cause})" in text


def test_the_report_lists_the_earlier_attempts(tmp_path: Path) -> None:
    from dsv4rl.faults.attempts import archive_attempt

    run_dir = make_run(tmp_path, recorded_rows()[:5])
    write_run_outcome(run_dir, RunOutcome("failed", 5, 1, "engine-0 was killed by SIGKILL"))
    archive_attempt(run_dir)  # as the launcher does when the next attempt starts
    (run_dir / "OUTCOME").unlink()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in recorded_rows()))
    result = runner.invoke(app, ["report", str(run_dir), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    said = "attempt 1: steps 1-5, crashed at step 5 (root cause: engine-0 was killed by SIGKILL)"
    assert f"earlier {said}" in result.output
    text = (tmp_path / "out" / "report.md").read_text()
    assert "## Earlier attempts" in text and said in text


def test_a_stopped_run_gives_the_stop_reason_and_a_finished_record_changes_nothing(tmp_path: Path) -> None:
    table = parse_metrics_text(RECORDED.read_text(), RECORDED)
    stopped = run_status(table, 30, idle_s=20, outcome=RunOutcome("stopped", 12, 75, None, reason="SIGTERM"))
    assert (stopped.state, stopped.sentence) == ("stopped", "stopped at step 12 (SIGTERM)")
    finished = run_status(table, 12, idle_s=20, outcome=RunOutcome("finished", 12, 0, None))
    assert finished == run_status(table, 12, idle_s=20)


def test_planned_steps_reads_the_saved_config_or_says_why_not(tmp_path: Path) -> None:
    assert planned_steps(tmp_path) == (None, "no config.yaml in the run dir: planned steps unknown")
    (tmp_path / "config-node0.yaml").write_text("train:\n  steps: 40\n")
    assert planned_steps(tmp_path) == (40, "`config-node0.yaml`, train.steps=40")
    (tmp_path / "config.yaml").write_text("train: {}\n")
    steps, note = planned_steps(tmp_path)
    assert steps is None and "`config.yaml` has no readable train.steps" in note


def test_other_commands_do_not_load_matplotlib() -> None:
    probe = "import sys, dsv4rl.cli, dsv4rl.report; print('matplotlib' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
