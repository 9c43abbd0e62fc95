"""The supervisor with node liveness: a peer node that stops, goes silent or never comes up stops this node
with a message naming it. Fake children and fake peers (heartbeats written from a thread of the test)."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from test_supervisor import (
    assert_all_gone,
    capture,
    engine_spec,
    in_watch_loop,
    remote_engine,
    supervisor,
    trainer_spec,
    wait_for,
    written_pids,
)

from dsv4rl.launcher.marker import DoneMarker, read_status
from dsv4rl.launcher.node_liveness import Heartbeat, NodeLiveness, heartbeat_path, read_heartbeat
from free_ports import free_port


@contextlib.contextmanager
def peer(run_dir: Path, node: int) -> Iterator[tuple[threading.Event, Heartbeat]]:
    """A peer node's supervisor, reduced to its heartbeat: beats until the event is set."""
    silenced = threading.Event()
    heartbeat = Heartbeat(run_dir, node, interval_s=0.1)

    def run() -> None:
        while not silenced.is_set():
            heartbeat.beat()
            time.sleep(0.05)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield silenced, heartbeat
    finally:
        silenced.set()
        thread.join()


def liveness(run_dir: Path, node: int, timeout_s: float = 1.0, startup_s: float = 10.0) -> NodeLiveness:
    return NodeLiveness(run_dir, node, nnodes=2, timeout_s=timeout_s, startup_s=startup_s)


def test_rollout_node_stops_when_node_0_goes_silent(tmp_path):
    console, out = capture()
    sup = supervisor(
        [engine_spec(tmp_path, free_port())],
        tmp_path,
        console,
        done_marker=DoneMarker(tmp_path),
        liveness=liveness(tmp_path, 1),
    )
    with peer(tmp_path, 0) as (silenced, _):
        thread = in_watch_loop(out, lambda: (time.sleep(0.5), silenced.set()))  # node 0 SIGKILLed
        start = time.monotonic()
        assert sup.run() == 1
        thread.join()
    text = out.getvalue()
    assert (
        "✗ node 0 (" in text and "has not been heard from for" in text and "cluster.node_timeout_s=1" in text
    )
    assert time.monotonic() - start < 10
    assert sup.children[0].proc.returncode == -signal.SIGTERM  # its engine was stopped
    final = read_heartbeat(heartbeat_path(tmp_path, 1))
    assert final["status"] == "failed" and "node 0" in final["reason"]
    assert not (tmp_path / "DONE").exists()
    assert_all_gone(written_pids(tmp_path))


def test_rollout_node_that_sees_node_0_stop_after_done_exits_0(tmp_path):
    """Node 0 writes DONE, then its last heartbeat: whichever the rollout node reads first, it finishes."""
    console, out = capture()
    sup = supervisor(
        [engine_spec(tmp_path, free_port())],
        tmp_path,
        console,
        done_marker=DoneMarker(tmp_path),
        liveness=liveness(tmp_path, 1),
    )
    with peer(tmp_path, 0) as (silenced, node0):

        def finish() -> None:
            silenced.set()
            DoneMarker(tmp_path).write("finished")
            node0.stop("finished")

        thread = in_watch_loop(out, finish)
        assert sup.run() == 0
        thread.join()
    assert "the trainer finished" in out.getvalue()
    assert read_heartbeat(heartbeat_path(tmp_path, 1))["status"] == "finished"


def test_node_0_stops_when_a_rollout_node_says_it_failed(tmp_path):
    console, out = capture()
    with remote_engine(free_port()) as url, peer(tmp_path, 1) as (silenced, node1):
        sup = supervisor(
            [trainer_spec(tmp_path, steps=1, mode="hang")],
            tmp_path,
            console,
            remote_engines=[("engine-1", url)],
            done_marker=DoneMarker(tmp_path),
            liveness=liveness(tmp_path, 0, timeout_s=30.0),
        )

        def engine_dies() -> None:
            wait_for(tmp_path / "trainer.pids")
            silenced.set()
            node1.stop("failed", "engine-1 was killed by SIGKILL (exit code -9)")

        thread = threading.Thread(target=engine_dies)
        thread.start()
        assert sup.run() == 1
        thread.join()
    text = out.getvalue()
    assert "✗ node 1 (" in text and "stopped (failed): engine-1 was killed by SIGKILL" in text
    assert read_status(tmp_path / "DONE") == "failed"
    assert "engine-1 was killed" in read_heartbeat(heartbeat_path(tmp_path, 0))["reason"]
    assert_all_gone(written_pids(tmp_path))


def test_a_failed_trainer_names_the_rollout_node_that_stopped_with_it(tmp_path):
    """The trainer's connection errors may end it before the poll loop reads the peer's last heartbeat."""
    console, out = capture()
    with remote_engine(free_port()) as url, peer(tmp_path, 1) as (silenced, node1):
        sup = supervisor(
            [trainer_spec(tmp_path, steps=1, mode="fail")],
            tmp_path,
            console,
            remote_engines=[("engine-1", url)],
            liveness=liveness(tmp_path, 0, timeout_s=30.0),
        )

        def engine_dies() -> None:
            wait_for(tmp_path / "trainer.pids")
            silenced.set()
            time.sleep(0.5)  # after the trainer has failed
            node1.stop("failed", "engine-1 was killed by SIGKILL (exit code -9)")

        thread = threading.Thread(target=engine_dies)
        thread.start()
        assert sup.run() == 3
        thread.join()
    text = out.getvalue()
    assert "trainer exited with code 3" in text
    assert "node 1 (" in text and "stopped (failed): engine-1 was killed by SIGKILL" in text


def test_node_0_names_the_rollout_node_that_never_came_up(tmp_path):
    console, out = capture()
    with remote_engine(free_port(), healthy_after_s=float("inf")) as url:
        sup = supervisor(
            [trainer_spec(tmp_path)],
            tmp_path,
            console,
            startup_timeout_s=1.0,
            remote_engines=[("engine-1", url)],
            done_marker=DoneMarker(tmp_path),
            liveness=liveness(tmp_path, 0, startup_s=1.0),
        )
        assert sup.run() == 1
    text = out.getvalue()
    assert "engine-1 (on another node) is not healthy" in text
    assert f"node 1: not heard from (no heartbeat in {heartbeat_path(tmp_path, 1)})" in text
    assert not (tmp_path / "logs" / "trainer.log").exists()


def test_node_0_stops_waiting_when_the_rollout_node_fails_at_startup(tmp_path):
    console, out = capture()
    with (
        remote_engine(free_port(), healthy_after_s=float("inf")) as url,
        peer(tmp_path, 1) as (silenced, node1),
    ):
        sup = supervisor(
            [trainer_spec(tmp_path)],
            tmp_path,
            console,
            startup_timeout_s=60.0,
            remote_engines=[("engine-1", url)],
            done_marker=DoneMarker(tmp_path),
            liveness=liveness(tmp_path, 0),
        )

        def crash() -> None:
            time.sleep(0.5)
            silenced.set()
            node1.stop("failed", "engine-1 exited with code 2")

        thread = threading.Thread(target=crash)
        thread.start()
        start = time.monotonic()
        assert sup.run() == 1
        thread.join()
    assert time.monotonic() - start < 20  # not the 60 s startup timeout
    text = out.getvalue()
    assert "✗ node 1 (" in text and "stopped (failed): engine-1 exited with code 2" in text
    assert not (tmp_path / "logs" / "trainer.log").exists()
    assert read_status(tmp_path / "DONE") == "failed"
