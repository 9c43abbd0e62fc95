"""The DONE marker contract between node 0 (writer) and rollout-only nodes (watchers)."""

from __future__ import annotations

import json

from dsv4rl.launcher.marker import DONE_FILE, DoneMarker, read_status, write_marker


def test_write_is_atomic_json_with_status(tmp_path):
    write_marker(tmp_path / DONE_FILE, "finished", step=100)
    record = json.loads((tmp_path / DONE_FILE).read_text())
    assert record["status"] == "finished" and record["step"] == 100 and "host" in record
    assert [p.name for p in tmp_path.iterdir()] == [DONE_FILE]  # no temporary file left behind


def test_plain_or_unreadable_marker_means_finished(tmp_path):
    path = tmp_path / DONE_FILE
    path.touch()
    assert read_status(path) == "finished"
    path.write_text("not json")
    assert read_status(path) == "finished"
    path.write_text('{"status": "failed"}')
    assert read_status(path) == "failed"


def test_only_a_marker_written_after_start_counts(tmp_path):
    write_marker(tmp_path / DONE_FILE, "finished")  # an earlier run's
    watcher = DoneMarker(tmp_path)
    assert not watcher.appeared()
    (tmp_path / DONE_FILE).unlink()  # node 0 clears it: still nothing
    assert not watcher.appeared()
    write_marker(tmp_path / DONE_FILE, "failed")
    assert watcher.appeared() and watcher.status() == "failed"


def test_writer_keeps_a_marker_the_trainer_wrote_itself(tmp_path):
    writer = DoneMarker(tmp_path)
    write_marker(tmp_path / DONE_FILE, "finished", step=7)  # e.g. trainer rank 0
    writer.write("failed")
    assert json.loads((tmp_path / DONE_FILE).read_text())["step"] == 7


def test_clear_removes_an_old_marker(tmp_path):
    write_marker(tmp_path / DONE_FILE, "finished")
    marker = DoneMarker(tmp_path)
    marker.clear()
    assert not (tmp_path / DONE_FILE).exists()
    marker.write("finished")
    assert marker.appeared() and marker.status() == "finished"
