"""Notices: what a process needs the user to read on the console, not only in its log.

A child's log is a file; the console is the supervisor's. A process that changes course on its own, such
as a resume that skips an unreadable checkpoint for an older one, says so with `notify(message)`: the
line goes to its logger and to `notice-<process>.jsonl` in the run's logs, which the supervisor tails
and prints (`dsv4rl.launcher.child_faults`). Without a supervisor (a module run by hand, a test) only the
logger gets it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path

_path: Path | None = None
_process = ""


def configure(path: Path, process: str) -> None:
    """Where this process's notices go (`dsv4rl.faults.child` calls it)."""
    global _path, _process
    _path, _process = Path(path), process


def notify(message: str, logger: logging.Logger | None = None) -> None:
    """Log `message` as a warning and put it on the supervisor's console."""
    (logger or logging.getLogger("dsv4rl")).warning("%s", message)
    if _path is None:
        return
    record = {"process": _process, "time": time.time(), "message": message}
    with contextlib.suppress(OSError), _path.open("a") as stream:  # a full disk must not stop the run
        stream.write(json.dumps(record) + "\n")


class NoticeReader:
    """The notices appended to one file since the last call (the supervisor's side)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._offset = 0

    def read_new(self) -> list[dict]:
        try:
            with self.path.open("rb") as stream:
                stream.seek(self._offset)
                data = stream.read()
        except OSError:
            return []
        end = data.rfind(b"\n")
        if end < 0:
            return []
        self._offset += end + 1
        found = []
        for line in data[: end + 1].splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict) and "message" in record:
                    found.append(record)
        return found
