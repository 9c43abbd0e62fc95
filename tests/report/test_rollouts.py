"""Rollout records: written by the loop's writer, read back by `dsv4rl rollouts` (rich and --json) and
linked from `dsv4rl report`."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from dsv4rl.cli import app
from dsv4rl.data.problems import Problem
from dsv4rl.faults.run_outcome import RunOutcome, write_run_outcome
from dsv4rl.report.rollouts import FIELDS, load_step, rollouts_section, saved_steps, select
from dsv4rl.reward.results import Outcome
from dsv4rl.samples import Sample
from dsv4rl.train.rollout_records import saves_rollouts, write_rollouts

runner = CliRunner()


def write_step(run_dir: Path, step: int) -> list[Sample]:
    samples = [
        Sample(
            0,
            [0, 5],
            [7],
            [-0.5],
            "7",
            "stop",
            answer="7",
            reward=1.0,
            advantage=0.9,
            versions=["3"],
        ),
        Sample(
            0, [0, 5], [8, 9, 1], [-0.1, -0.2, -0.3], "8x", "length", answer="7", reward=0.0, advantage=-0.9
        ),
        Sample(1, [0, 6], [2, 2], [-1.0, -1.0], "22", "stop", answer="2", excluded=True),
    ]
    problems = [Problem("3+4=", "7", "3+4"), Problem("3+4=", "7", "3+4"), Problem("1+1=", "2", "1+1")]
    outcomes = [
        {
            "ok": Outcome(1.0, {"len": 1.0}),
            "judge": Outcome(None, {}, "timeout", "no result within timeout_s=1"),
        },
        {"ok": Outcome(0.0, {"len": 2.0}), "judge": Outcome(0.5)},
        {"ok": Outcome(None, {}, "none"), "judge": Outcome(None, {}, "error", "JudgeParseError: no score")},
    ]
    write_rollouts(run_dir, step, samples, problems, outcomes, None, samples[:2])
    return samples


def test_records_hold_every_field_and_read_back(tmp_path: Path) -> None:
    assert saves_rollouts(5, 10) and not saves_rollouts(5, 11) and not saves_rollouts(0, 10)
    write_step(tmp_path, 10)
    write_step(tmp_path, 20)
    assert saved_steps(tmp_path) == [10, 20]
    step, records = load_step(tmp_path)
    assert step == 20 and len(records) == 3
    assert all(set(FIELDS) == set(record) for record in records)
    first = records[0]
    assert (first["prompt"], first["response"], first["logprobs"], first["weight_version"]) == (
        "3+4=",
        "7",
        [-0.5],
        "3",
    )
    assert first["versions"] == [["3", 0, 1]]
    assert first["rewards"]["judge"] == {
        "score": None,
        "status": "timeout",
        "error": "no result within timeout_s=1",
    }
    assert first["trained"] and records[2]["advantage"] is None and records[2]["excluded"]
    best, worst = select(records, 1, "reward")
    assert best[0]["index"] == 0 and worst[0]["index"] == 1  # the excluded sample sorts last, after the worst
    longest, shortest = select(records, 1, "length")
    assert longest[0]["index"] == 1 and shortest[0]["index"] == 0


def test_the_rollouts_command(tmp_path: Path) -> None:
    write_step(tmp_path, 10)
    shown = runner.invoke(app, ["rollouts", str(tmp_path), "--step", "10", "--n", "1"])
    assert shown.exit_code == 0, shown.output
    assert "step 10: 3 samples; the 1 best and 1 worst" in shown.output and "3+4=" in shown.output
    assert "judge" in shown.output and "timeout" in shown.output
    as_json = runner.invoke(app, ["rollouts", str(tmp_path), "--step", "10", "--json"])
    data = json.loads(as_json.output)
    assert data["step"] == 10 and [r["index"] for r in data["samples"]] == [0, 1, 2]
    missing = runner.invoke(app, ["rollouts", str(tmp_path), "--step", "11"])
    assert (
        missing.exit_code == 2
        and "no rollouts saved for step 11" in missing.output
        and "10" in missing.output
    )
    empty = runner.invoke(app, ["rollouts", str(tmp_path / "none")])
    assert empty.exit_code == 2 and "is not a directory" in empty.output
    assert "run crashed" not in shown.output and data["run_end"] is None


def test_the_rollouts_of_a_crashed_run_say_how_it_ended(tmp_path: Path) -> None:
    write_step(tmp_path, 10)
    write_run_outcome(tmp_path, RunOutcome("failed", 12, 1, "engine-0 was killed by SIGKILL"))
    said = "crashed at step 12 (root cause: engine-0 was killed by SIGKILL)"
    shown = runner.invoke(app, ["rollouts", str(tmp_path)])
    assert shown.exit_code == 0 and f"run {said}" in shown.output, shown.output
    as_json = json.loads(runner.invoke(app, ["rollouts", str(tmp_path), "--json"]).output)
    assert as_json["run_end"] == said


def test_the_report_links_the_saved_steps(tmp_path: Path) -> None:
    write_step(tmp_path, 10)
    lines = rollouts_section(tmp_path, tmp_path / "report")
    assert "dsv4rl rollouts" in lines[0] and lines[-1] == "- [step 10](../rollouts/step_00000010.jsonl)"
    assert rollouts_section(tmp_path / "report", tmp_path) == []
