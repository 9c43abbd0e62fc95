"""Reading metrics.jsonl into columns: partial and malformed lines are skipped with a note, never silently."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsv4rl.report.metrics_table import (
    MetricsTable,
    ReportError,
    load_metrics_table,
    parse_metrics_text,
    rolling_mean,
)

RECORDED = Path(__file__).parent / "data" / "metrics_tiny_arith.jsonl"


def _lines(*rows: dict) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def test_recorded_file_reads_every_step() -> None:
    table = parse_metrics_text(RECORDED.read_text(), RECORDED)
    assert table.steps == list(range(1, 13))
    assert table.notes == []
    assert not table.partial_last_line
    steps, rewards = table.column("reward_mean")
    assert steps == table.steps
    assert rewards[0] == json.loads(RECORDED.read_text().splitlines()[0])["reward_mean"]
    assert table.time_phases() == ["rollout", "reward", "train", "sync"]


def test_partial_last_line_is_skipped_with_a_note_even_when_it_parses() -> None:
    text = _lines({"step": 1, "reward_mean": 0.5}) + json.dumps({"step": 2, "reward_mean": 0.7})
    table = parse_metrics_text(text, Path("m.jsonl"))
    assert table.steps == [1]
    assert table.partial_last_line
    assert len(table.notes) == 1 and table.notes[0].startswith("line 2 skipped: partial last line")


def test_malformed_middle_lines_are_skipped_with_their_line_numbers() -> None:
    text = (
        _lines({"step": 1, "reward_mean": 0.1})
        + '{"step": 2, "reward_mean": \n'
        + "[1, 2]\n"
        + _lines({"reward_mean": 0.3}, {"step": 5, "reward_mean": 0.5})
    )
    table = parse_metrics_text(text, Path("m.jsonl"))
    assert table.steps == [1, 5]
    assert [note.split(":")[0] for note in table.notes] == [
        "line 2 skipped",
        "line 3 skipped",
        "line 4 skipped",
    ]
    assert "not JSON" in table.notes[0]
    assert "not an object" in table.notes[1]
    assert "no integer 'step'" in table.notes[2]
    assert not table.partial_last_line


def test_repeated_step_keeps_the_later_line_and_says_so() -> None:
    text = _lines(
        {"step": 1, "reward_mean": 0.1}, {"step": 2, "reward_mean": 0.2}, {"step": 1, "reward_mean": 0.9}
    )
    table = parse_metrics_text(text, Path("m.jsonl"))
    assert table.steps == [1, 2]
    assert table.column("reward_mean") == ([1, 2], [0.9, 0.2])
    assert table.notes == ["line 3 repeats step 1: the later line is used"]


def test_columns_hold_only_finite_numbers_of_the_steps_that_have_them() -> None:
    rows = [
        {"step": 1, "kl": None, "eval/pass@1": 0.25},
        {"step": 2, "kl": 0.5, "flag": True},
        {"step": 3, "kl": "nan?", "eval/pass@1": 0.5},
    ]
    table = MetricsTable(path=Path("m.jsonl"), rows=rows)
    assert table.column("kl") == ([2], [0.5])
    assert table.column("eval/pass@1") == ([1, 3], [0.25, 0.5])
    assert not table.has("flag") and not table.has("absent")
    assert table.keys_with_prefix("eval/") == ["eval/pass@1"]


def test_time_phases_put_the_loops_phases_first_then_others() -> None:
    rows = [{"step": 1, "time_step_s": 3.0, "time_eval_s": 1.0, "time_train_s": 1.5, "time_rollout_s": 0.5}]
    assert MetricsTable(path=Path("m.jsonl"), rows=rows).time_phases() == ["rollout", "train", "eval"]


def test_rolling_mean_uses_shorter_windows_at_the_start() -> None:
    assert rolling_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert rolling_mean([2.0, 4.0, 6.0], 10) == [2.0, 3.0, 4.0]


def test_missing_run_dir_and_missing_metrics_file_are_errors(tmp_path: Path) -> None:
    with pytest.raises(ReportError, match="does not exist"):
        load_metrics_table(tmp_path / "nope")
    with pytest.raises(ReportError, match="has no metrics.jsonl"):
        load_metrics_table(tmp_path)


@pytest.mark.parametrize(
    ("text", "why"),
    [("", "the file is empty"), ('{"step": 1, "rew', "partial last line"), ("garbage\n", "line 1 skipped")],
)
def test_a_file_without_a_complete_step_line_is_an_error(tmp_path: Path, text: str, why: str) -> None:
    (tmp_path / "metrics.jsonl").write_text(text)
    with pytest.raises(ReportError, match="no complete step line") as error:
        load_metrics_table(tmp_path)
    assert why in str(error.value)
