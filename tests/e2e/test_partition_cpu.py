"""Two nodes cut apart: `tiny_arith` as a two-node job (node 0 the trainer, node 1 the engine) with each
node in a network namespace of its own, joined by a veth pair, each with its own address. The link is cut
mid-run: the run must stop within the configured timeouts, name the node it can no longer reach, and
leave nothing running. The nodes still share the run dir on the filesystem (as on a cluster's shared
filesystem), so node liveness alone sees both alive: only the network is cut.

Making namespaces needs root (CAP_NET_ADMIN) and iproute2's `ip`; where they cannot be made, the test is
skipped and says why."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_runs import CLI
from test_two_nodes_cpu import Node, assert_no_process_left, job, wait_for_steps

from dsv4rl.engine_client.engine_keys import ADMIN_KEY_ENV, API_KEY_ENV
from dsv4rl.launcher.node_liveness import heartbeat_path, read_heartbeat
from dsv4rl.metrics import read_metrics
from free_ports import port_overrides

pytestmark = pytest.mark.slow

# The timeouts the cut must be caught within. A rollout request or a weight-sync step that gets no answer
# fails after these; node 1 hears of it through the DONE marker node 0 writes in the shared run dir.
REQUEST_TIMEOUT_S = 20  # engine.request_timeout_s
SYNC_TIMEOUT_S = 20  # sync.timeout_s: the weight-update group's gloo timeout on both ends
NODE_TIMEOUT_S = 10  # cluster.node_timeout_s
STOP_MARGIN_S = 60  # reporting, stack-less teardown (SIGTERM, then SIGKILL after 10 s) on 2 busy cores


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


class Network:
    """Two namespaces `ns[0]`, `ns[1]` joined by a veth pair, `addr[0]`/`addr[1]` on a /24 of 10.213/16.
    Both ends of the pair have one name, `nic`, as a cluster's nodes name their NICs alike: gloo is told
    to use it (GLOO_SOCKET_IFNAME), else it takes the address the hostname resolves to (loopback here)."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.ns = (f"dsv4rl-{tag}-n0", f"dsv4rl-{tag}-n1")
        self.nic = f"d4{tag}"  # interface names: 15 characters at most
        subnet = int(tag, 16) % 250 + 1
        self.addr = (f"10.213.{subnet}.1", f"10.213.{subnet}.2")

    def up(self) -> str | None:
        """Make the namespaces and the link; None, or why they cannot be made here."""
        if shutil.which("ip") is None:
            return "no `ip` command (install iproute2)"
        for ns in self.ns:
            made = _ip("netns", "add", ns)
            if made.returncode != 0:
                return f"`ip netns add` failed (needs root / CAP_NET_ADMIN): {made.stderr.strip()}"
        steps = [("link", "add", self.nic, "netns", self.ns[0], "type", "veth", "peer", "name", self.nic,
                  "netns", self.ns[1])]  # fmt: skip
        for node in (0, 1):
            steps += [
                ("-n", self.ns[node], "addr", "add", f"{self.addr[node]}/24", "dev", self.nic),
                ("-n", self.ns[node], "link", "set", "lo", "up"),
                ("-n", self.ns[node], "link", "set", self.nic, "up"),
            ]
        for step in steps:
            done = _ip(*step)
            if done.returncode != 0:
                return f"`ip {' '.join(step)}` failed: {done.stderr.strip()}"
        return None

    def cut(self) -> None:
        """The link goes down on both ends: packets are dropped, no connection is refused or reset."""
        for node in (0, 1):
            assert _ip("-n", self.ns[node], "link", "set", self.nic, "down").returncode == 0

    def down(self) -> None:
        for ns in self.ns:  # deleting a namespace deletes the veth end in it, and with it the pair
            _ip("netns", "del", ns)


@contextlib.contextmanager
def network() -> Iterator[Network]:
    net = Network()
    try:
        why = net.up()
        if why is not None:
            pytest.skip(f"network namespaces cannot be made here: {why}")
        yield net
    finally:
        net.down()
    assert not any(ns in _ip("netns", "list").stdout for ns in net.ns)


class NodeIn(Node):
    """A `dsv4rl train` node run inside network namespace `ns` (`ip netns exec` execs it: same pid)."""

    def __init__(self, tmp_path: Path, run_dir: Path, rank: int, ns: str, *overrides: str):
        self.rank = rank
        self.out = tmp_path / f"node{rank}.out"
        argv = ["ip", "netns", "exec", ns, *CLI, "recipe=tiny_arith", f"run.dir={run_dir}"]
        argv += ["run.progress=false", f"cluster.node_rank={rank}", *overrides]
        env = {**os.environ, ADMIN_KEY_ENV: "partition-test-admin", API_KEY_ENV: "partition-test-api"}
        with self.out.open("w") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
            )


def test_a_partition_between_two_nodes_stops_the_run_naming_the_unreachable_node(tmp_path: Path) -> None:
    with network() as net, job(tmp_path) as (run_dir, nodes):
        addrs = f"cluster.node_addrs=[{net.addr[0]},{net.addr[1]}]"
        settings = (
            *port_overrides(), "train.steps=40", "eval.every_steps=0",
            "cluster.nnodes=2", addrs, f"cluster.master_addr={net.addr[0]}",
            "parallel.train.nnodes=1", "parallel.rollout.nnodes=1",
            "engine.host=0.0.0.0",  # node 0 reaches node 1's engine at node 1's address
            f"+comm.env.GLOO_SOCKET_IFNAME={net.nic}",
            f"engine.request_timeout_s={REQUEST_TIMEOUT_S}", f"sync.timeout_s={SYNC_TIMEOUT_S}",
            f"cluster.node_timeout_s={NODE_TIMEOUT_S}",
            "run.step_timeout_s=600",  # the watchdog is not what stops this run
        )  # fmt: skip
        nodes += [NodeIn(tmp_path, run_dir, rank, net.ns[rank], *settings) for rank in (1, 0)]
        node1, node0 = nodes
        wait_for_steps(run_dir, 2, node0)  # the two nodes train together over the link
        net.cut()
        cut_at = time.monotonic()
        assert node0.wait(timeout=max(REQUEST_TIMEOUT_S, SYNC_TIMEOUT_S) + 3 * STOP_MARGIN_S) == 1
        stopped_0 = time.monotonic() - cut_at
        assert node1.wait(timeout=NODE_TIMEOUT_S + STOP_MARGIN_S) == 1
        stopped_1 = time.monotonic() - cut_at
        assert_no_process_left(run_dir)
    text0, text1 = node0.output(), node1.output()
    print(f"after the cut: node 0 stopped in {stopped_0:.1f} s, node 1 in {stopped_1:.1f} s")
    assert stopped_0 < max(REQUEST_TIMEOUT_S, SYNC_TIMEOUT_S) + STOP_MARGIN_S, (stopped_0, text0)
    assert stopped_1 < stopped_0 + NODE_TIMEOUT_S + STOP_MARGIN_S, (stopped_1, text1)
    # node 0 names node 1 and its address as what it cannot reach; the trainer's own error says what timed out
    named = f"node 1 ({net.addr[1]}) cannot be reached from this node: engine-0 at {net.addr[1]}:"
    assert named in text0, text0
    cause = re.search(r"root cause: trainer-rank0: .*", text0)  # a request or broadcast to that address
    assert cause is not None and (net.addr[1] in cause.group(0) or "engine-0" in cause.group(0)), text0
    # node 1 stops because node 0 said the run failed (the DONE marker in the shared run dir)
    assert "the run ended with status 'failed'" in text1 or "node 0 (" in text1, text1
    assert read_heartbeat(heartbeat_path(run_dir, 0))["status"] == "failed"
    steps = len(read_metrics(run_dir / "metrics.jsonl"))
    assert 2 <= steps < 40
