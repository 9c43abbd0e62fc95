"""`tiny_arith` as a two-node job on this machine: two `dsv4rl train` processes sharing one run dir, node 0
with the trainer, node 1 with the engine (`parallel.train.nnodes=1 parallel.rollout.nnodes=1`), both nodes'
addresses loopback. Covers the run to its end and a node that never comes up or dies mid-run."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_runs import CLI, NON_TIMING, SHORT_RUN

from dsv4rl.launcher.node_liveness import heartbeat_path, read_heartbeat
from dsv4rl.metrics import read_metrics
from free_ports import port_overrides

TWO_NODES = (
    "cluster.nnodes=2",
    "cluster.node_addrs=[127.0.0.1,127.0.0.1]",
    "parallel.train.nnodes=1",
    "parallel.rollout.nnodes=1",
)


class Node:
    """One `dsv4rl train` process of the job, its output in `<tmp>/node<r>.out`."""

    def __init__(self, tmp_path: Path, run_dir: Path, rank: int, *overrides: str):
        self.rank = rank
        self.out = tmp_path / f"node{rank}.out"
        argv = [*CLI, "recipe=tiny_arith", f"run.dir={run_dir}", "run.progress=false", *TWO_NODES]
        argv += [f"cluster.node_rank={rank}", *overrides]
        with self.out.open("w") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def output(self) -> str:
        return self.out.read_text()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"node {self.rank} still runs after {timeout} s:\n{self.output()}") from None

    def started_pid(self, name: str, timeout: float = 120) -> int:
        """The pid of child `name` from this node's 'started <name> (pid N)' line."""
        deadline = time.monotonic() + timeout
        while (found := re.search(rf"started {name} \(pid (\d+)\)", self.output())) is None:
            assert self.proc.poll() is None and time.monotonic() < deadline, self.output()
            time.sleep(0.2)
        return int(found.group(1))


def processes_of(run_dir: Path) -> list[int]:
    """Every process whose command line names the run dir (engines, torchrun, trainer ranks)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if str(run_dir).encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
    return pids


@contextlib.contextmanager
def job(tmp_path: Path) -> Iterator[tuple[Path, list[Node]]]:
    """A run dir and the nodes started into it; whatever of them is still running afterwards is killed."""
    run_dir = tmp_path / "run"
    nodes: list[Node] = []
    try:
        yield run_dir, nodes
    finally:
        for node in nodes:
            if node.proc.poll() is None:
                node.proc.kill()
                node.proc.wait()
        for pid in processes_of(run_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def wait_for_steps(run_dir: Path, steps: int, node: Node, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and len(read_metrics(metrics)) >= steps):
        assert node.proc.poll() is None and time.monotonic() < deadline, node.output()
        time.sleep(0.2)


def assert_no_process_left(run_dir: Path, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while processes_of(run_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_of(run_dir) == []


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a run of 6 steps, beside the session's: minutes on a busy machine
def test_two_nodes_give_the_one_node_curve(short_arith: Path, tmp_path: Path) -> None:
    """The same seed and overrides on one node (the session's short run) and on two: the same rewards,
    gradients and entropies, step by step, and the same eval at the last step. The reference engine and
    seeded sampling make every step reproducible, so 6 steps check what 120 would."""
    with job(tmp_path) as (run_dir, nodes):
        ports = port_overrides()  # the same on both nodes: node 1's engine port is what node 0 dials
        nodes += [Node(tmp_path, run_dir, rank, *ports, *SHORT_RUN) for rank in (1, 0)]  # engine node first
        node1, node0 = nodes
        codes = [node0.wait(timeout=1500), node1.wait(timeout=120)]
        assert codes == [0, 0], node0.output() + node1.output()
    ours, theirs = read_metrics(run_dir / "metrics.jsonl"), read_metrics(short_arith / "metrics.jsonl")
    assert len(ours) == len(theirs) == 6
    for two, one in zip(ours, theirs, strict=True):
        assert {key: two[key] for key in NON_TIMING} == {key: one[key] for key in NON_TIMING}, two["step"]
    assert "eval/pass@1" in theirs[5] and ours[5]["eval/pass@1"] == theirs[5]["eval/pass@1"]
    assert "the trainer finished" in node1.output()  # node 1 stopped at node 0's DONE marker
    assert (run_dir / "config-node0.yaml").is_file() and (run_dir / "config-node1.yaml").is_file()
    assert {read_heartbeat(heartbeat_path(run_dir, n))["status"] for n in (0, 1)} == {"finished"}
    assert "engine-0" in (run_dir / "logs" / "engine-0.log").read_text()
    assert_no_process_left(run_dir)


@pytest.mark.slow
def test_node_0_stops_when_node_1_never_comes_up(tmp_path: Path) -> None:
    with job(tmp_path) as (run_dir, nodes):
        nodes.append(Node(tmp_path, run_dir, 0, *port_overrides(), "engine.startup_timeout_s=5"))
        assert nodes[0].wait(timeout=300) == 1
    text = nodes[0].output()
    assert "engine-0 (on another node) is not healthy" in text and "not healthy after waiting 5" in text
    assert "node 1: not heard from" in text
    assert "started trainer" not in text
    assert read_heartbeat(heartbeat_path(run_dir, 0))["status"] == "failed"


@pytest.mark.slow
def test_node_0_stops_when_node_1s_engine_dies(tmp_path: Path) -> None:
    with job(tmp_path) as (run_dir, nodes):
        ports = port_overrides()
        nodes += [Node(tmp_path, run_dir, rank, *ports, "train.steps=30") for rank in (1, 0)]
        node1, node0 = nodes
        engine = node1.started_pid("engine-0")
        wait_for_steps(run_dir, 1, node0)
        os.kill(engine, signal.SIGKILL)
        assert node1.wait(timeout=60) == 128 + signal.SIGKILL
        assert node0.wait(timeout=60) == 1  # stopped, not hanging in a rollout or a weight broadcast
        assert_no_process_left(run_dir)
    text = node0.output()
    assert "node 1 (" in text and "stopped (failed): engine-0 was killed by SIGKILL" in text
    assert len(read_metrics(run_dir / "metrics.jsonl")) < 30


@pytest.mark.slow
def test_node_1_stops_when_node_0_dies(tmp_path: Path) -> None:
    """Node 0's supervisor killed outright writes no DONE marker; node 1 stops once its heartbeat is
    older than cluster.node_timeout_s instead of serving forever."""
    with job(tmp_path) as (run_dir, nodes):
        settings = (*port_overrides(), "train.steps=30", "cluster.node_timeout_s=5")
        nodes += [Node(tmp_path, run_dir, rank, *settings) for rank in (1, 0)]
        node1, node0 = nodes
        wait_for_steps(run_dir, 1, node0)
        node0.proc.kill()  # the supervisor: its trainer follows (PDEATHSIG), nothing writes DONE
        node0.proc.wait()
        killed_at = time.monotonic()
        assert node1.wait(timeout=60) == 1
        assert 3 <= time.monotonic() - killed_at < 40  # heard from up to a beat (1 s) before the kill
        assert_no_process_left(run_dir)
    text = node1.output()
    assert "node 0 (" in text and "has not been heard from for" in text and "node_timeout_s=5" in text
    assert not (run_dir / "DONE").exists()
