"""Earlier attempts kept: what a new attempt would cut or clear is copied to attempts/<n>/ first."""

from __future__ import annotations

import json
from pathlib import Path

from dsv4rl.faults.attempts import ATTEMPTS_DIR, archive_attempt, earlier_attempts
from dsv4rl.faults.run_outcome import RunOutcome, write_run_outcome


def crashed_run(run_dir: Path, steps: int = 3) -> dict[str, bytes]:
    """A run dir as a crashed attempt leaves it; returns the files an archive must hold."""
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s}) + "\n" for s in range(1, steps + 1))
    )
    write_run_outcome(run_dir, RunOutcome("failed", steps, 1, "trainer-rank0: EngineError: ReadError('')"))
    (run_dir / "logs" / "crash-trainer-rank0.json").write_text('{"type": "EngineError"}')
    (run_dir / "logs" / "notice-trainer-rank0.jsonl").write_text('{"message": "m"}\n')
    (run_dir / "logs" / "stacks-engine-0.txt").write_text("Thread ...")
    (run_dir / "logs" / "trainer.log").write_text("appended to, never cleared\n")
    names = ["metrics.jsonl", "OUTCOME", "logs/crash-trainer-rank0.json", "logs/notice-trainer-rank0.jsonl",
             "logs/stacks-engine-0.txt"]  # fmt: skip
    return {name: (run_dir / name).read_bytes() for name in names}


def test_a_first_attempt_has_nothing_to_keep(tmp_path: Path) -> None:
    assert archive_attempt(tmp_path) is None and not (tmp_path / ATTEMPTS_DIR).exists()
    assert earlier_attempts(tmp_path) == []


def test_each_new_attempt_keeps_the_last_ones_files_under_its_number(tmp_path: Path) -> None:
    kept = crashed_run(tmp_path)
    first = archive_attempt(tmp_path)
    assert first == tmp_path / ATTEMPTS_DIR / "1"
    assert {name: (first / name).read_bytes() for name in kept} == kept
    assert not (first / "logs" / "trainer.log").exists()  # logs are appended to: they stay in place
    assert (tmp_path / "metrics.jsonl").read_bytes() == kept["metrics.jsonl"]  # copied, not moved
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')  # the second attempt's
    assert archive_attempt(tmp_path) == tmp_path / ATTEMPTS_DIR / "2"
    attempts = earlier_attempts(tmp_path)
    assert [a.line() for a in attempts] == [
        "attempt 1: steps 1-3, crashed at step 3 (root cause: trainer-rank0: EngineError: ReadError(''))",
        "attempt 2: steps 1-2, crashed at step 3 (root cause: trainer-rank0: EngineError: ReadError(''))",
    ]


def test_an_attempt_without_records_still_reads(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 4}\n{"step": 5, "cut')  # a line a crash cut short
    archive_attempt(tmp_path)
    (attempt,) = earlier_attempts(tmp_path)
    assert attempt.line() == "attempt 1: steps 4-4, how it ended was not recorded"
