"""Heartbeat files: what a trainer and an engine write as they enter phases, and the hang test hook."""

from __future__ import annotations

import json

import pytest

from dsv4rl.faults import heartbeat
from dsv4rl.faults.heartbeat import Beat, Heartbeat, read_beat
from dsv4rl.faults.inject import (
    FAIL_ENV,
    HANG_ENV,
    KILL_ENV,
    HangPoint,
    InjectedFault,
    maybe_hang,
    parse_hang_points,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_trainer_enters_phases_in_order(tmp_path):
    clock = Clock()
    path = tmp_path / "heartbeat-trainer-rank0.json"
    beat = Heartbeat(path, "trainer-rank0", clock)
    first = read_beat(path)
    assert (first.process, first.phase, first.step, first.since, first.busy) == (
        "trainer-rank0",
        "start",
        None,
        1000.0,
        False,
    )
    clock.now = 1005.0
    beat.enter("train", 2)
    seen = read_beat(path)
    assert (seen.phase, seen.step, seen.since, seen.last_progress) == ("train", 2, 1005.0, 1005.0)
    assert seen.pid == beat.pid and seen.host
    assert not list(tmp_path.glob(".*.tmp"))  # written aside, then renamed


def test_a_configured_process_writes_behind_and_the_newest_beat_lands(tmp_path, monkeypatch):
    """`configure` (what every run process calls) writes on a thread of its own: `enter` returns while a
    write is stuck, and once it is free the file holds the newest phase."""
    import threading

    import dsv4rl.faults.heartbeat as module

    writes, started, stuck = [], threading.Event(), threading.Event()
    real = module.write_json_atomic

    def stuck_write(path, record, **options):
        writes.append(record["phase"])
        started.set()
        stuck.wait(10)  # a filesystem that does not answer until the test lets it
        real(path, record, **options)

    monkeypatch.setattr(module, "write_json_atomic", stuck_write)
    monkeypatch.setattr(module, "_heartbeat", None)
    path = tmp_path / "heartbeat-trainer-rank0.json"
    beat = heartbeat.configure(path, "trainer-rank0")
    assert started.wait(10)  # the writer is stuck in the first write, of phase start
    for step in range(1, 11):
        heartbeat.enter("rollout", step)
        heartbeat.enter("train", step)
    assert writes == ["start"]  # every enter returned while the first write was stuck
    stuck.set()
    assert beat.flush()
    seen = read_beat(path)
    assert (seen.phase, seen.step) == ("train", 10)
    assert writes == ["start", "train"]  # the 20 beats recorded meanwhile went out as the newest one
    assert not list(tmp_path.glob(".*.tmp"))


def test_progress_is_written_at_most_once_a_second(tmp_path):
    clock = Clock()
    path = tmp_path / "hb.json"
    beat = Heartbeat(path, "trainer-rank0", clock)
    beat.enter("rollout", 1)
    clock.now += 0.5
    beat.progress()
    assert read_beat(path).last_progress == 1000.0  # too soon after the last write
    clock.now += 0.6
    beat.progress()
    assert read_beat(path).last_progress == 1001.1
    assert read_beat(path).since == 1000.0  # still the same phase


def test_a_server_is_busy_with_its_oldest_piece_of_work_then_idle(tmp_path):
    clock = Clock()
    path = tmp_path / "hb.json"
    beat = Heartbeat(path, "engine-0", clock)
    with beat.busy("generate"):
        clock.now = 1001.0
        with beat.busy("weight_update"):
            seen = read_beat(path)
            assert (seen.phase, seen.since, seen.busy) == ("generate", 1000.0, True)
        clock.now = 1002.0
        assert read_beat(path).phase == "generate"
    seen = read_beat(path)
    assert (seen.phase, seen.since, seen.busy) == ("idle", 1002.0, False)


def test_a_piece_of_work_carries_its_step_and_its_points_are_fault_points(tmp_path, monkeypatch):
    """An engine's weight update is busy at its session's step; `reached` inside it is a point a test can
    make fail, at that step (the hook is replaced here by a recorder)."""
    import dsv4rl.faults.heartbeat as module

    seen = []
    monkeypatch.setattr(module, "maybe_hang", lambda process, point, step, **_: seen.append((point, step)))
    monkeypatch.setattr(module, "_heartbeat", None)
    module.reached("weight_broadcast")  # not configured: nothing
    hb = module.configure(tmp_path / "hb.json", "engine-0")
    with module.busy("weight_update", 2):
        assert hb.flush()
        beat = read_beat(tmp_path / "hb.json")
        assert (beat.phase, beat.step, beat.busy) == ("weight_update", 2, True)
        module.reached("weight_broadcast")
    module.reached("weight_broadcast")  # outside any work: no step
    assert seen == [("weight_update", 2), ("weight_broadcast", 2), ("weight_broadcast", None)]
    assert hb.flush() and read_beat(tmp_path / "hb.json").step is None  # idle again


def test_module_functions_do_nothing_until_configured(tmp_path, monkeypatch):
    monkeypatch.setattr(heartbeat, "_heartbeat", None)
    heartbeat.enter("train", 1)
    heartbeat.progress()
    with heartbeat.busy("generate"):
        pass
    hb = heartbeat.configure(tmp_path / "hb.json", "engine-3")
    heartbeat.enter("sync", 4)
    assert hb.flush()  # a configured heartbeat writes behind
    assert heartbeat.current() is hb and read_beat(tmp_path / "hb.json").phase == "sync"


def test_a_beat_with_missing_fields_is_ignored(tmp_path):
    path = tmp_path / "hb.json"
    path.write_text(json.dumps({"process": "x", "pid": 1}))
    assert read_beat(path) is None
    path.write_text("not json")
    assert read_beat(path) is None
    assert Beat.from_json({"process": "x", "pid": "1", "host": "h", "phase": "p", "since": 2}).step is None


def test_hang_points_parse_and_match():
    points = parse_hang_points("trainer:train:2, engine-0:generate")
    assert points == [HangPoint("trainer", "train", 2), HangPoint("engine-0", "generate")]
    train, generate = points
    assert train.matches("trainer-rank1", "train", 2) and train.matches("trainer", "train", 2)
    assert not train.matches("trainer-rank1", "train", 3) and not train.matches("trainer-rank1", "sync", 2)
    assert generate.matches("engine-0", "generate", None) and not generate.matches(
        "engine-01", "generate", None
    )
    for bad in ("trainer", "trainer:train:x", ":train"):
        with pytest.raises(ValueError, match=HANG_ENV):
            parse_hang_points(bad)


def test_a_kill_point_parses_like_a_hang_point_and_names_its_variable(monkeypatch):
    monkeypatch.setenv(KILL_ENV, "engine-0:weight_broadcast:x")
    with pytest.raises(ValueError, match=KILL_ENV):
        maybe_hang("engine-0", "weight_broadcast", 1)
    monkeypatch.setenv(KILL_ENV, "engine-0:weight_broadcast:2")
    maybe_hang("engine-0", "weight_broadcast", 1)  # another step: nothing happens
    maybe_hang("engine-1", "weight_broadcast", 2)  # (that it kills: tests/faults/test_child_process.py)


def test_a_fail_point_raises_there_only(monkeypatch):
    monkeypatch.setenv(FAIL_ENV, "engine-0:weight_broadcast:3")
    maybe_hang("engine-0", "weight_broadcast", 2)
    maybe_hang("engine-1", "weight_broadcast", 3)
    with pytest.raises(
        InjectedFault, match="DSV4RL_INJECT_FAIL: engine-0 fails in weight_broadcast at step 3"
    ):
        maybe_hang("engine-0", "weight_broadcast", 3)


def test_an_injected_hang_ignores_other_processes_and_steps(monkeypatch):
    monkeypatch.setenv(HANG_ENV, "trainer-rank0:train:2")
    maybe_hang("trainer-rank0", "train", 1)
    maybe_hang("trainer-rank1", "train", 2)
    maybe_hang("engine-0", "train", 2)  # (that it blocks: tests/faults/test_child_process.py)
