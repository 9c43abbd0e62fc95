"""The run's OUTCOME record: what a person reads for each way a run ends, and a record that cannot be read."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsv4rl.faults.run_outcome import (
    OUTCOME_FILE,
    RunOutcome,
    clear_run_outcome,
    read_run_outcome,
    write_run_outcome,
)


@pytest.mark.parametrize(
    ("outcome", "said"),
    [
        (RunOutcome("finished", 120, 0, None), "finished at step 120"),
        (RunOutcome("failed", 12, 1, "trainer: ValueError: bad (at x.py:3)"),
         "crashed at step 12 (root cause: trainer: ValueError: bad (at x.py:3))"),
        (RunOutcome("hung", 3, 1, "in phase train at step 3: trainer-rank0 did not advance"),
         "hung at step 3 (root cause: in phase train at step 3: trainer-rank0 did not advance)"),
        (RunOutcome("stopped", 40, 75, "engine-0 stopped", reason="SIGTERM"), "stopped at step 40 (SIGTERM)"),
        (RunOutcome("failed_push", 7, 1, "engine-1 failed a push"),
         "stopped after a failed weight push at step 7 (root cause: engine-1 failed a push)"),
        (RunOutcome("failed", 0, 1, None), "crashed before step 1"),
    ],
)  # fmt: skip
def test_each_ending_reads_as_a_sentence(outcome: RunOutcome, said: str) -> None:
    assert outcome.sentence() == said


def test_the_record_round_trips_and_a_new_attempt_clears_it(tmp_path: Path) -> None:
    outcome = RunOutcome("failed", 12, 1, "engine-0 was killed by SIGKILL", time=5.0)
    write_run_outcome(tmp_path, outcome)
    assert read_run_outcome(tmp_path) == outcome
    clear_run_outcome(tmp_path)
    assert read_run_outcome(tmp_path) is None
    clear_run_outcome(tmp_path)  # nothing to clear is no error


@pytest.mark.parametrize(
    "text", ["", "{", "[1]", '{"outcome": "failed"}', '{"outcome": "x", "last_step": "a"}']
)
def test_an_unreadable_record_counts_as_none(tmp_path: Path, text: str) -> None:
    (tmp_path / OUTCOME_FILE).write_text(text)
    assert read_run_outcome(tmp_path) is None  # the report then judges from metrics.jsonl alone
