"""One launcher per run dir and node: `<run_dir>/lock-node<r>` names the `dsv4rl train` that owns it.

Two launchers on one run.dir would overwrite each other's config, truncate each other's metrics.jsonl and
mix their checkpoints, whatever their ports. So the launcher locks this file before it writes anything
else, and a second one is refused, naming the holder. The lock is a `flock` on the file, which the kernel
releases when the holder dies however it dies; the file's JSON record (host, pid, node, command) is only
for the message, and for a stale lock's notice: a lock whose holder is gone is taken over, and said so.
Each node of a multi-node run locks its own name (its node rank), so the nodes of one run never refuse
each other.

Network filesystems: flock spans hosts on NFSv4, Lustre and GPFS mounted with locking. Where it cannot
lock at all (ENOLCK, EOPNOTSUPP) or locks per host only (NFS `nolock`), the record still refuses a live
holder on this host.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from dsv4rl.launcher.procs import read_proc

RUNNING = "running"
RELEASED = "released"


class RunDirInUse(ValueError):
    """The run dir belongs to an earlier or a running run, and this launcher may not use it."""


class RunDirLocked(RunDirInUse):
    """Another launcher holds this node's lock on the run dir."""


class RunDirUnwritable(RunDirInUse):
    """The run dir cannot be written (permissions, a read-only or full filesystem)."""


def lock_path(run_dir: Path | str, node_rank: int = 0) -> Path:
    return Path(run_dir) / f"lock-node{node_rank}"


def unwritable(run_dir: Path, error: OSError) -> RunDirUnwritable:
    reason = error.strerror or type(error).__name__
    where = f" ({error.filename})" if error.filename and str(error.filename) != str(run_dir) else ""
    return RunDirUnwritable(
        f"run.dir {run_dir} cannot be written: {reason}{where}; choose a directory you can write with "
        "run.dir=PATH, or fix its permissions"
    )


def _start_ticks(pid: int) -> int | None:
    proc = read_proc(pid)
    return None if proc is None else proc.start


def _alive_here(record: dict[str, Any]) -> bool:
    """The record's process runs on this host (the same process: its start time matches)."""
    if record.get("host") != socket.gethostname() or not isinstance(record.get("pid"), int):
        return False
    start = _start_ticks(record["pid"])
    recorded = record.get("start")
    return start is not None and (recorded is None or start == recorded)


def describe_holder(record: dict[str, Any]) -> str:
    since = record.get("time")
    when = f", since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))}" if since else ""
    return f"pid {record.get('pid', '?')} on {record.get('host', '?')}{when}"


class RunLock:
    """This node's lock on `run_dir`: `holder()` looks without writing, `acquire()` takes it (a notice
    when it took over a stale one), `release()` gives it back. Keep one object per process: closing any
    other descriptor of the file would drop a POSIX lock on network filesystems."""

    def __init__(self, run_dir: Path | str, node_rank: int = 0) -> None:
        self.run_dir = Path(run_dir)
        self.node_rank = node_rank
        self.path = lock_path(run_dir, node_rank)
        self._fd: int | None = None

    # ---------------------------------------------------------------------------------------- reading
    @staticmethod
    def _read(fd: int) -> dict[str, Any] | None:
        with contextlib.suppress(OSError, ValueError):
            data = os.pread(fd, 1 << 16, 0)
            record = json.loads(data or b"null")
            if isinstance(record, dict):
                return record
        return None

    def holder(self) -> dict[str, Any] | None:
        """The record of a live holder, or None (no lock file, a released or stale one). Writes nothing."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return None  # no lock yet; an unreadable one is named when acquiring
        try:
            record = self._read(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return record or {}
            except OSError:
                pass  # no flock here: the record decides
            else:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
        if record and record.get("status") == RUNNING and _alive_here(record):
            return record  # flock free, yet its holder lives: a filesystem that locks nothing
        return None

    def refused(self, record: dict[str, Any]) -> RunDirLocked:
        argv = record.get("command") if isinstance(record.get("command"), list) else []
        command = next((f"dsv4rl {arg}" for arg in argv if arg in ("train", "eval", "align")), "dsv4rl train")
        return RunDirLocked(
            f"run.dir {self.run_dir} is in use by another {command} ({describe_holder(record)}, node "
            f"{record.get('node', self.node_rank)}): a second launcher would overwrite its config, metrics "
            f"and checkpoints, whatever its ports. Wait for it to end or stop it, or choose another run.dir "
            f"(lock {self.path})"
        )

    # ---------------------------------------------------------------------------------------- writing
    def acquire(self) -> str | None:
        """Take the lock, creating the run dir; returns a notice when a stale lock was taken over. Raises
        RunDirLocked (a live holder) or RunDirUnwritable."""
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise unwritable(self.run_dir, error) from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise self.refused(self._read(fd) or {}) from None
            except OSError:
                pass  # no flock here (ENOLCK, EOPNOTSUPP): the record decides
            previous = self._read(fd)
            if previous and previous.get("status") == RUNNING and _alive_here(previous):
                raise self.refused(previous)
            self._write(fd, RUNNING)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        if previous and previous.get("status") == RUNNING:
            return (
                f"took over the lock {self.path} of a dsv4rl train that is gone "
                f"({describe_holder(previous)}): it never released it (killed, or its machine lost)"
            )
        return None

    def _write(self, fd: int, status: str) -> None:
        record = {
            "status": status,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "start": _start_ticks(os.getpid()),
            "node": self.node_rank,
            "time": time.time(),
            "command": sys.argv,
        }
        data = (json.dumps(record) + "\n").encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)

    def release(self) -> None:
        """Mark the record released and drop the lock (the file stays: removing it would let a waiter lock
        a file no one else sees)."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            self._write(self._fd, RELEASED)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
