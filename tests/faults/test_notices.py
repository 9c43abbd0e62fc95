"""Notices: a child's line for the supervisor's console, also in its log."""

from __future__ import annotations

import logging

from dsv4rl.faults import notices
from dsv4rl.faults.notices import NoticeReader


def test_a_notice_goes_to_the_log_and_to_the_file_the_supervisor_tails(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(notices, "_path", None)
    with caplog.at_level(logging.WARNING):
        notices.notify("by hand: only logged")
    assert "by hand: only logged" in caplog.text
    path = tmp_path / "notice-trainer-rank0.jsonl"
    reader = NoticeReader(path)
    assert reader.read_new() == []  # no file yet
    notices.configure(path, "trainer-rank0")
    notices.notify("checkpoint step_3 cannot be loaded; falling back to step_2")
    (first,) = reader.read_new()
    assert (first["process"], first["message"]) == (
        "trainer-rank0",
        "checkpoint step_3 cannot be loaded; falling back to step_2",
    )
    with path.open("a") as stream:
        stream.write('not json\n{"message": "half')
    assert reader.read_new() == []  # a bad line skipped, a partial one left for later
    with path.open("a") as stream:
        stream.write(' a line"}\n')
    assert [r["message"] for r in reader.read_new()] == ["half a line"]
    monkeypatch.setattr(notices, "_path", None)
