"""The end-of-run marker `<run_dir>/DONE`: how a node that only serves rollouts learns the run is over.

Multi-node runs share `run.dir`. Node 0 (where trainer rank 0 runs) writes the marker when its trainer
exits: one JSON object, `{"status": "finished"}` on success, `"failed"` or `"interrupted"` otherwise,
written atomically (a temporary file renamed over `DONE`). A rollout-only node's supervisor watches for
it, then stops its engines and exits: 0 for "finished", 1 for anything else. Without it such a node
would serve forever and its Slurm job step would never end.

A marker left by an earlier run in the same directory never counts: a watcher only accepts a marker
that appears, or changes, after the watcher started (the writer's rename makes a new file).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from dsv4rl.faults.files import write_json_atomic

DONE_FILE = "DONE"
FINISHED = "finished"


def _identity(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def write_marker(path: Path, status: str, *, durable: bool = True, **info: Any) -> None:
    """Atomically write `{"status": status, "time": ..., "host": ..., **info}` to `path`; `durable`: fsynced
    before and after the rename, so a requeued job finds it after a machine crash (`write_json_atomic`)."""
    record = {"status": status, "time": time.time(), "host": socket.gethostname(), **info}
    write_json_atomic(Path(path), record, durable=durable)


def read_status(path: Path) -> str:
    """The marker's status; an empty or non-JSON marker (`touch DONE`) means finished."""
    try:
        record = json.loads(Path(path).read_text() or "{}")
    except (ValueError, OSError):
        return FINISHED
    status = record.get("status", FINISHED) if isinstance(record, dict) else FINISHED
    return str(status)


class DoneMarker:
    """`<run_dir>/DONE` as seen by one supervisor: remembers what was there when it started."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / DONE_FILE
        self._initial = _identity(self.path)

    def clear(self) -> None:
        """Remove an earlier run's marker (node 0, before anything starts)."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self._initial = None

    def appeared(self) -> bool:
        """True once a marker written after this object was made is there."""
        current = _identity(self.path)
        return current is not None and current != self._initial

    def status(self) -> str:
        return read_status(self.path)

    def write(self, status: str, **info: Any) -> None:
        """Write the marker unless this run already wrote one (e.g. trainer rank 0 itself)."""
        if not self.appeared():
            write_marker(self.path, status, **info)
