"""The failed-push record and the requeue bound (`dsv4rl.faults.failed_push`)."""

from __future__ import annotations

import json
from pathlib import Path

from dsv4rl.faults.failed_push import (
    FAILED_PUSH_EXIT,
    FailedPushRecord,
    clear_failed_push,
    decide_requeue,
    failed_push_path,
    requeue_count,
    requeues_path,
    write_failed_push,
)
from dsv4rl.faults.stop import STOPPED_EXIT


def test_the_exit_code_is_its_own() -> None:
    assert FAILED_PUSH_EXIT not in (0, 1, 2, STOPPED_EXIT, 130)


def test_only_a_record_written_after_the_supervisor_started_counts(tmp_path: Path) -> None:
    write_failed_push(tmp_path, 2, None, "an earlier launch's")
    seen = FailedPushRecord(tmp_path)
    assert seen.read() is None
    write_failed_push(tmp_path, 5, str(tmp_path / "checkpoints" / "step_00000004"), "bucket 0: HTTP 400")
    record = seen.read()
    assert (record["step"], record["reason"]) == (5, "bucket 0: HTTP 400")
    assert record["checkpoint"].endswith("step_00000004")


def test_requeues_are_counted_in_the_run_dir_up_to_the_bound(tmp_path: Path) -> None:
    decisions = []
    for _ in range(3):
        write_failed_push(tmp_path, 7, None, "x")
        decisions.append(decide_requeue(tmp_path, max_requeues=2))
    assert [(d.allowed, d.count, d.exit_code) for d in decisions] == [
        (True, 1, FAILED_PUSH_EXIT),
        (True, 2, FAILED_PUSH_EXIT),
        (False, 2, 1),
    ]
    record = json.loads(failed_push_path(tmp_path).read_text())
    assert (record["requeue"], record["requeues"], record["max_requeues"], record["step"]) == (False, 2, 2, 7)
    assert '"requeue": false' in failed_push_path(tmp_path).read_text()  # what the batch script greps
    assert "from step 0 (no checkpoint yet)" in decisions[0].message("dsv4rl train ... resume=auto")
    refused = decisions[2].message("dsv4rl train ... resume=auto")
    assert "cluster.max_requeues=2" in refused and "not again" in refused and "REQUEUES" in refused
    clear_failed_push(tmp_path)  # a new launch: the record goes, the count stays
    assert not failed_push_path(tmp_path).exists() and requeue_count(tmp_path) == 2


def test_zero_requeues_never_requeues_and_a_broken_count_reads_as_none(tmp_path: Path) -> None:
    write_failed_push(tmp_path, 1, None, "x")
    assert not decide_requeue(tmp_path, max_requeues=0).allowed
    requeues_path(tmp_path).write_text("not json")
    assert requeue_count(tmp_path) == 0
