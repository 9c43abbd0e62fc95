"""The restart request between the trainer and the supervisors: asked, answered, cleared."""

from __future__ import annotations

from dsv4rl.faults import restart_requests as rr


def test_a_request_is_pending_until_answered_and_an_earlier_answer_is_dropped(tmp_path) -> None:
    rr.answer_request(tmp_path, "engine-1", False, "an earlier attempt's")
    rr.request_restart(tmp_path, "engine-1", 7, "the push of step 7 failed half way")
    assert rr.read_answer(tmp_path, "engine-1") is None  # asked afresh: no answer yet
    request = rr.pending_request(tmp_path, "engine-1")
    assert (request["step"], request["reason"]) == (7, "the push of step 7 failed half way")
    assert rr.pending_request(tmp_path, "engine-0") is None
    rr.answer_request(tmp_path, "engine-1", True)
    assert rr.pending_request(tmp_path, "engine-1") is None
    assert rr.read_answer(tmp_path, "engine-1") == {"restarted": True, "why": ""}
    rr.clear(tmp_path, "engine-1")
    assert rr.read_answer(tmp_path, "engine-1") is None and not list(tmp_path.iterdir())
