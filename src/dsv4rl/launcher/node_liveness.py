"""Node liveness in multi-node runs: each node's supervisor says it is alive; each watches the nodes it
depends on, so a node that dies or never comes up stops the others with a message naming it.

Why: a rollout-only node learns that the run is over from node 0's DONE marker, and node 0 learns that a
rollout node is gone only when a request to its engines fails (or a weight broadcast hangs until
`sync.timeout_s`). A node killed outright (SIGKILL, a machine lost) writes no marker: without a liveness
signal its peers would serve, or wait, forever.

Each supervisor rewrites `<run_dir>/nodes/node<r>.json` (shared run dir) about once a second while it
runs, `{"status": "running", "node", "host", "pid", "started", "beat", "time"}`, and once more when it
exits, with its final status ("finished", "failed", "interrupted") and the reason. Node 0 watches every
other node; every other node watches node 0. A watched node is lost when
- its file says it stopped (any status but "running"),
- its file has not changed for `cluster.node_timeout_s`, or
- it was never heard from within `startup_s` (engine.startup_timeout_s) of the watcher starting.
Silence is timed on the watcher's own monotonic clock, so clock skew between nodes does not matter. A
file left by an earlier run counts only once it changes, as with the DONE marker. On NFS, keep the
attribute cache (`actimeo`) well below `cluster.node_timeout_s`.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsv4rl.launcher.marker import write_marker

NODES_DIR = "nodes"
RUNNING = "running"
Clock = Callable[[], float]


def heartbeat_path(run_dir: Path, node: int) -> Path:
    return Path(run_dir) / NODES_DIR / f"node{node}.json"


def watched_nodes(node_rank: int, nnodes: int) -> list[int]:
    """Node 0 (trainer rank 0, the DONE marker) depends on every node; every other node on node 0."""
    if nnodes <= 1:
        return []
    return list(range(1, nnodes)) if node_rank == 0 else [0]


def read_heartbeat(path: Path) -> dict[str, Any] | None:
    """The record, or None when the file is missing or half-written elsewhere (read again next time)."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _identity(record: dict[str, Any] | None) -> tuple | None:
    if record is None:
        return None
    return record.get("host"), record.get("pid"), record.get("started"), record.get("beat")


class Heartbeat:
    """This node's file: `beat()` rewrites it at most every `interval_s`, `stop()` once at the end."""

    def __init__(self, run_dir: Path, node_rank: int, interval_s: float = 1.0, clock: Clock = time.monotonic):
        self.path = heartbeat_path(run_dir, node_rank)
        self.node_rank = node_rank
        self.interval_s = interval_s
        self._clock = clock
        self._started = time.time()
        self._beats = 0
        self._last = -float("inf")

    def beat(self) -> None:
        now = self._clock()
        if now - self._last >= self.interval_s:
            self._last = now
            with contextlib.suppress(OSError):  # a shared-filesystem hiccup: the next beat tries again
                self._write(RUNNING, durable=False)  # a beat is stale in seconds: no fsync once a second

    def stop(self, status: str, reason: str = "") -> None:
        with contextlib.suppress(OSError):
            self._write(status, durable=True, reason=reason)

    def _write(self, status: str, *, durable: bool, **info: Any) -> None:
        self._beats += 1
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_marker(
            self.path, status, durable=durable, node=self.node_rank, pid=os.getpid(), started=self._started,
            beat=self._beats, **info,
        )  # fmt: skip


@dataclass
class _Seen:
    identity: tuple | None  # what the file held when last read
    changed_at: float  # watcher's clock: when it last changed (or when watching began)
    record: dict[str, Any] | None = None  # the newest record written after watching began
    heard: bool = False


class NodeWatch:
    """The nodes this one depends on, as seen from here: `lost()` names the first one gone."""

    def __init__(
        self,
        run_dir: Path,
        nodes: list[int],
        timeout_s: float,
        startup_s: float,
        clock: Clock = time.monotonic,
    ):
        self.run_dir = Path(run_dir)
        self.timeout_s = timeout_s
        self.startup_s = startup_s
        self._clock = clock
        start = clock()
        self._seen = {
            node: _Seen(_identity(read_heartbeat(heartbeat_path(run_dir, node))), start) for node in nodes
        }

    @property
    def nodes(self) -> list[int]:
        return list(self._seen)

    def _refresh(self, node: int) -> _Seen:
        seen = self._seen[node]
        record = read_heartbeat(heartbeat_path(self.run_dir, node))
        identity = _identity(record)
        if identity is not None and identity != seen.identity:
            seen.identity, seen.changed_at, seen.record, seen.heard = identity, self._clock(), record, True
        return seen

    def lost(self, stopped_only: bool = False) -> str | None:
        """A message naming the first watched node that stopped, went silent or never came up; None while
        all are alive. `stopped_only`: only nodes that said they stopped (while peers may still start)."""
        for node in self._seen:
            seen = self._refresh(node)
            silent = self._clock() - seen.changed_at
            path = heartbeat_path(self.run_dir, node)
            if seen.heard and seen.record is not None:
                status = str(seen.record.get("status", RUNNING))
                if status != RUNNING:
                    reason = seen.record.get("reason") or "no reason given"
                    return f"node {node} ({_who(seen.record)}) stopped ({status}): {reason}"
                if silent > self.timeout_s and not stopped_only:
                    return (
                        f"node {node} ({_who(seen.record)}) has not been heard from for {silent:.0f} s "
                        f"(cluster.node_timeout_s={self.timeout_s:g}; {path}): it died or hangs; its "
                        "supervisor's output says why"
                    )
            elif silent > self.startup_s and not stopped_only:
                return (
                    f"node {node} never came up: no heartbeat in {path} within {self.startup_s:g} s "
                    "(engine.startup_timeout_s); start `dsv4rl train` there with the same run.dir and "
                    f"cluster.node_rank={node}"
                )
        return None

    def summary(self) -> list[str]:
        """One line per watched node: what was last heard from it, and how long ago."""
        lines = []
        for node in self._seen:
            seen = self._refresh(node)
            if seen.heard and seen.record is not None:
                silent = self._clock() - seen.changed_at
                status = seen.record.get("status", RUNNING)
                lines.append(f"node {node} ({_who(seen.record)}): {status}, last heard {silent:.1f} s ago")
            else:
                lines.append(
                    f"node {node}: not heard from (no heartbeat in {heartbeat_path(self.run_dir, node)})"
                )
        return lines


def _who(record: dict[str, Any]) -> str:
    return f"{record.get('host', '?')}, supervisor pid {record.get('pid', '?')}"


class NodeLiveness:
    """This node's heartbeat and its watch over the nodes it depends on, as the supervisor uses them."""

    def __init__(self, run_dir: Path, node_rank: int, nnodes: int, timeout_s: float, startup_s: float):
        self.node_rank = node_rank
        self.heartbeat = Heartbeat(run_dir, node_rank, interval_s=min(1.0, timeout_s / 5))
        self.watch = NodeWatch(run_dir, watched_nodes(node_rank, nnodes), timeout_s, startup_s)

    def poll(self, stopped_only: bool = False) -> str | None:
        """Beat (rate-limited), then the first lost node's message, or None."""
        self.heartbeat.beat()
        return self.watch.lost(stopped_only)

    def settle(self, wait_s: float, poll_s: float = 0.1) -> str | None:
        """After a child failed: give a peer that stopped at the same time `wait_s` to say so (a remote
        node's engine gone is the likelier cause of a trainer's connection errors)."""
        deadline = time.monotonic() + wait_s
        while True:
            message = self.poll(stopped_only=True)
            if message is not None or time.monotonic() >= deadline:
                return message
            time.sleep(poll_s)

    def stop(self, status: str, reason: str = "") -> None:
        self.heartbeat.stop(status, reason)
