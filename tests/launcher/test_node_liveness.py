"""Node liveness: heartbeats in the shared run dir, and watchers that name a node that stopped, went silent
or never came up. Clocks are fakes, so silence is simulated, not waited for."""

from __future__ import annotations

import json

import pytest

from dsv4rl.launcher.node_liveness import (
    Heartbeat,
    NodeLiveness,
    NodeWatch,
    heartbeat_path,
    read_heartbeat,
    watched_nodes,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_node_0_watches_every_node_and_the_others_watch_node_0():
    assert watched_nodes(0, 1) == []
    assert watched_nodes(0, 4) == [1, 2, 3]
    assert watched_nodes(2, 4) == [0]


def test_heartbeat_is_rate_limited_and_ends_with_the_final_status(tmp_path):
    clock = FakeClock()
    beat = Heartbeat(tmp_path, 1, interval_s=1.0, clock=clock)
    beat.beat()
    first = read_heartbeat(heartbeat_path(tmp_path, 1))
    assert first["status"] == "running" and first["node"] == 1 and first["beat"] == 1
    clock.now += 0.5
    beat.beat()  # too soon: not rewritten
    assert read_heartbeat(heartbeat_path(tmp_path, 1))["beat"] == 1
    clock.now += 0.6
    beat.beat()
    assert read_heartbeat(heartbeat_path(tmp_path, 1))["beat"] == 2
    beat.stop("failed", "engine-0 was killed by SIGKILL (exit code -9)")
    last = json.loads(heartbeat_path(tmp_path, 1).read_text())
    assert last["status"] == "failed" and "engine-0 was killed" in last["reason"]
    assert [p.name for p in heartbeat_path(tmp_path, 1).parent.iterdir()] == ["node1.json"]  # no temp file


def watch(tmp_path, clock, nodes=(1,), timeout_s=5.0, startup_s=30.0) -> NodeWatch:
    return NodeWatch(tmp_path, list(nodes), timeout_s=timeout_s, startup_s=startup_s, clock=clock)


def test_a_beating_node_is_alive_and_a_silent_one_is_lost(tmp_path):
    clock = FakeClock()
    node1 = Heartbeat(tmp_path, 1, interval_s=1.0, clock=clock)
    watcher = watch(tmp_path, clock)
    for _ in range(10):  # 10 s of beats once a second
        node1.beat()
        assert watcher.lost() is None
        clock.now += 1.0
    clock.now += 5.5  # then nothing (SIGKILL)
    message = watcher.lost()
    assert message is not None and message.startswith("node 1 (")
    assert "has not been heard from for 6 s" in message and "cluster.node_timeout_s=5" in message
    assert watcher.lost(stopped_only=True) is None  # silence is not a stop


def test_a_node_that_says_it_stopped_is_lost_at_once_with_its_reason(tmp_path):
    clock = FakeClock()
    node1 = Heartbeat(tmp_path, 1, clock=clock)
    watcher = watch(tmp_path, clock)
    node1.beat()
    assert watcher.lost() is None
    node1.stop("failed", "engine-0 was killed by SIGKILL (exit code -9)")
    for stopped_only in (True, False):
        message = watcher.lost(stopped_only)
        assert message is not None and "node 1" in message
        assert "stopped (failed): engine-0 was killed by SIGKILL" in message


def test_a_node_never_heard_from_is_lost_after_the_startup_bound(tmp_path):
    clock = FakeClock()
    watcher = watch(tmp_path, clock, timeout_s=5.0, startup_s=30.0)
    clock.now += 29.0
    assert watcher.lost() is None  # still starting, perhaps
    clock.now += 2.0
    message = watcher.lost()
    assert message is not None and message.startswith("node 1 never came up")
    assert str(heartbeat_path(tmp_path, 1)) in message and "cluster.node_rank=1" in message
    assert watcher.summary() == [f"node 1: not heard from (no heartbeat in {heartbeat_path(tmp_path, 1)})"]


def test_an_earlier_runs_file_counts_only_once_it_changes(tmp_path):
    clock = FakeClock()
    earlier = Heartbeat(tmp_path, 0, clock=clock)
    earlier.stop("finished")  # left behind by an earlier run in this run dir
    watcher = watch(tmp_path, clock, nodes=(0,), startup_s=30.0)
    clock.now += 10.0
    assert watcher.lost() is None  # not taken for this run's node 0 stopping
    node0 = Heartbeat(tmp_path, 0, clock=clock)  # this run's node 0 comes up
    node0.beat()
    assert watcher.lost() is None
    clock.now += 25.0  # past the startup bound, but heard from 25 s ago: silent for 25 s > timeout 5 s
    assert "has not been heard from" in watcher.lost()


def test_silence_is_timed_on_the_watchers_clock(tmp_path):
    """The writer's wall-clock time in the file does not matter (nodes' clocks may disagree)."""
    clock = FakeClock()
    watcher = watch(tmp_path, clock)
    path = heartbeat_path(tmp_path, 1)
    path.parent.mkdir()
    record = {"status": "running", "host": "n1", "pid": 7, "started": 1.0, "beat": 1, "time": 0.0}
    path.write_text(json.dumps(record))  # a clock years behind
    assert watcher.lost() is None
    clock.now += 4.0
    assert watcher.lost() is None
    assert watcher.summary() == ["node 1 (n1, supervisor pid 7): running, last heard 4.0 s ago"]


def test_a_half_written_file_is_read_again_later(tmp_path):
    clock = FakeClock()
    watcher = watch(tmp_path, clock)
    path = heartbeat_path(tmp_path, 1)
    path.parent.mkdir()
    path.write_text('{"status": "runn')
    assert watcher.lost() is None and read_heartbeat(path) is None


@pytest.mark.parametrize("node_rank", [0, 1])
def test_liveness_beats_and_watches_its_peer(tmp_path, node_rank):
    ours = NodeLiveness(tmp_path, node_rank, 2, timeout_s=5.0, startup_s=30.0)
    peer = NodeLiveness(tmp_path, 1 - node_rank, 2, timeout_s=5.0, startup_s=30.0)
    assert ours.poll() is None and peer.poll() is None
    assert ours.heartbeat.interval_s == 1.0
    assert read_heartbeat(heartbeat_path(tmp_path, node_rank))["status"] == "running"
    peer.stop("interrupted", "SIGTERM received")
    assert f"node {1 - node_rank}" in ours.settle(wait_s=1.0) and "(interrupted)" in ours.poll()


def test_settle_returns_none_when_every_peer_is_alive(tmp_path):
    ours = NodeLiveness(tmp_path, 0, 2, timeout_s=5.0, startup_s=30.0)
    NodeLiveness(tmp_path, 1, 2, timeout_s=5.0, startup_s=30.0).poll()
    assert ours.settle(wait_s=0.2, poll_s=0.05) is None
