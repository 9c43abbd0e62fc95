"""`dsv4rl eval SET --responses FILE`: saved generations graded without an engine (CLI in-process)."""

from __future__ import annotations

import json
from itertools import combinations
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dataset_files import DATA, needs_data
from dsv4rl.cli import app


def brute_force(correct: list[bool], k: int) -> float:
    subsets = list(combinations(range(len(correct)), k))
    return sum(any(correct[i] for i in s) for s in subsets) / len(subsets)


def run_eval(tmp_path: Path, lines: list[dict] | str, *extra: str):
    path = tmp_path / "responses.jsonl"
    path.write_text(lines if isinstance(lines, str) else "\n".join(json.dumps(x) for x in lines) + "\n")
    argv = ["eval", "aime24", f"data.path={DATA / 'aime24.jsonl'}", f"run.dir={tmp_path / 'run'}",
            "eval.grader=answer_line", "--responses", str(path), *extra]  # fmt: skip
    return CliRunner().invoke(app, argv)


@needs_data
def test_pass_at_k_of_saved_responses_equals_the_unbiased_estimator(tmp_path: Path) -> None:
    aime = [json.loads(line) for line in (DATA / "aime24.jsonl").read_text().splitlines()]
    patterns = [[True, False, False, False], [True, True, False, True], [False] * 4, [True] * 4]
    lines = []
    for row, pattern in zip(aime[:4], patterns, strict=True):
        wrong = str(int(row["answer"]) + 1)
        lines.append(
            {"id": row["id"], "responses": [f"Answer: {row['answer'] if ok else wrong}" for ok in pattern]}
        )
    lines.append({"id": "2023-I-1", "responses": ["Answer: 1"] * 4})  # not in AIME 2024
    result = run_eval(tmp_path, lines, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    for k in (1, 2, 4):
        expected = sum(brute_force(p, k) for p in patterns) / len(patterns)
        assert report[f"pass@{k}"] == pytest.approx(expected)
    assert report["avg@4"] == pytest.approx(report["pass@1"])
    assert report["maj@4"] == 0.5  # majority right on patterns 2 and 4
    assert report["problems"] == 4 and report["truncation_ratio"] is None
    assert report["unknown_ids"] == [{"line": 5, "id": "2023-I-1"}]
    assert len(report["missing"]) == 26 and "2024-I-5" in report["missing"]
    assert report["seconds"]["grade"] >= 0 and report["sampling"] is None
    saved = json.loads((tmp_path / "run" / "eval" / "aime24" / "eval.json").read_text())
    assert saved["pass@1"] == report["pass@1"]
    assert [row["correct"] for row in report["per_problem"]] == [1, 3, 0, 4]


@needs_data
def test_the_table_names_unknown_and_missing_problems(tmp_path: Path) -> None:
    result = run_eval(
        tmp_path, [{"id": "2024-I-1", "responses": ["Answer: 204"]}, {"id": "x", "responses": ["1"]}]
    )
    assert result.exit_code == 0, result.output
    assert "pass@1" in result.output and "2024-I-1" in result.output
    assert (
        "ids not in the eval set: ['x']" in result.output
        and "29 problem(s) without responses" in result.output
    )


@needs_data
@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"id": "2024-I-1", "responses": ["a"]}\nnot json\n', "line 2: not JSON"),
        ('{"id": "2024-I-1"}\n', 'line 1: expected {"id": ..., "responses"'),
        ('{"id": "2024-I-1", "responses": "a"}\n', "line 1: responses must be a list of strings"),
        ('{"id": "nope", "responses": ["a"]}\n', "no line matches a problem of eval 'aime24'"),
        (
            '{"id": "2024-I-1", "responses": ["a"]}\n{"id": "2024-I-2", "responses": ["a", "b"]}\n',
            "different numbers of responses ([1, 2])",
        ),
    ],
)
def test_bad_response_files_are_named(tmp_path: Path, content: str, message: str) -> None:
    result = run_eval(tmp_path, content)
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())


def test_an_unknown_eval_set_or_preset_is_refused(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["eval", "aime25", f"run.dir={tmp_path}"])
    assert result.exit_code == 2 and "aime25" in result.output
    result = CliRunner().invoke(app, ["eval", "aime24", "--preset", "greedy"])
    assert result.exit_code == 2 and "--preset 'greedy' is unknown" in result.output


def test_presets_set_temperature_and_top_p_and_overrides_win() -> None:
    from dsv4rl.config.compose import compose
    from dsv4rl.eval.presets import SamplingPreset, preset_overrides

    cfg = compose("tiny_arith", ["eval=aime24", *preset_overrides(SamplingPreset.deepseek_r1)])
    assert (cfg.eval.sampling.temperature, cfg.eval.sampling.top_p) == (0.6, 0.95)
    cfg = compose(
        "tiny_arith", ["eval=aime24", *preset_overrides(SamplingPreset.dapo), "eval.sampling.temperature=0.9"]
    )
    assert (cfg.eval.sampling.temperature, cfg.eval.sampling.top_p) == (0.9, 0.7)
