"""Heartbeats: each process says which phase it is in, so the supervisor can tell a stuck step.

A process writes `heartbeat-<process>.json` (`Beat`) when it enters a phase, not on a timer: a phase
that stays the same for `run.step_timeout_s` is what the watchdog looks for, and a process that hangs
could not keep a timer going anyway (a stuck collective holds the GIL). Two kinds of writers:

- the trainer loop `enter`s its phases in order (rollout, reward, train, sync, eval, checkpoint) with
  the step; `progress()` (a finished engine request) says a long phase is still moving;
- a server (the engine) marks each piece of work `busy` (a generate batch, a weight update) and is
  `idle` in between; concurrent pieces are tracked, the oldest is reported.

One heartbeat per process, configured by `dsv4rl.faults.child`; without it these calls do nothing (a
module run by hand, a test). The file names the pid, which the supervisor signals for stack dumps.

A configured process writes behind: `enter` and `busy` update the beat and wake a writer thread, which
replaces the file with the newest beat. Replacing a file by rename starts the new file's writeback on
ext4, and a step enters several phases on each side, so the writes stay off the step's path. A writer
blocked by a process whose main thread holds the GIL leaves the previous phase in the file, which still
stops changing: the hang is still seen, in the phase before.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dsv4rl.faults.files import read_json, write_json_atomic
from dsv4rl.faults.inject import maybe_hang

IDLE = "idle"
START = "start"
PROGRESS_WRITE_S = 1.0  # progress alone rewrites the file at most this often


@dataclass(frozen=True)
class Beat:
    """One heartbeat file: where `process` (pid `pid` on `host`) is, and since when (wall clock)."""

    process: str
    pid: int
    host: str
    phase: str
    step: int | None
    since: float  # entered the phase (servers: started the work, or went idle)
    progress_at: float  # the last sign of progress inside the phase
    busy: bool  # a server in the middle of a piece of work

    @property
    def last_progress(self) -> float:
        return max(self.since, self.progress_at)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Beat | None:
        try:
            step = data.get("step")
            return cls(
                process=str(data["process"]),
                pid=int(data["pid"]),
                host=str(data["host"]),
                phase=str(data["phase"]),
                step=None if step is None else int(step),
                since=float(data["since"]),
                progress_at=float(data.get("progress_at", data["since"])),
                busy=bool(data.get("busy", False)),
            )
        except (KeyError, TypeError, ValueError):
            return None


def read_beat(path: Path) -> Beat | None:
    data = read_json(path)
    return None if data is None else Beat.from_json(data)


class Heartbeat:
    """The heartbeat file of this process; thread-safe (an engine's generator and HTTP threads share it)."""

    def __init__(
        self, path: Path, process: str, clock: Callable[[], float] = time.time, *, behind: bool = False
    ) -> None:
        self.path = Path(path)
        self.process = process
        self.pid = os.getpid()
        self._host = socket.gethostname()
        self._clock = clock
        self._lock = threading.Lock()
        self._behind = behind  # write on a thread of its own (see the module docstring)
        self._changed = threading.Condition(self._lock)
        self._unwritten = 0  # beats not yet on disk (behind: counted until the writer has written them)
        self._writer: threading.Thread | None = None
        now = clock()
        self._phase, self._step, self._since = START, None, now
        self._progress_at = now
        self._written_at = float("-inf")
        self._busy: dict[int, tuple[str, float, int | None]] = {}  # token -> (activity, since, step)
        self._tokens = itertools.count()
        with self._lock:
            self._write()

    def enter(self, phase: str, step: int | None = None) -> None:
        """This process is now in `phase` (of `step`) until it enters the next one."""
        with self._lock:
            self._phase, self._step, self._since = phase, step, self._clock()
            self._write()
        maybe_hang(self.process, phase, step, settle=self.flush)

    @contextmanager
    def busy(self, activity: str, step: int | None = None) -> Iterator[None]:
        """A piece of a server's work (of `step`, when it has one); the process is `idle` again when no
        piece is left."""
        with self._lock:
            token = next(self._tokens)
            self._busy[token] = (activity, self._clock(), step)
            self._write()
        outer = getattr(_work, "step", None)
        _work.step = step
        try:
            maybe_hang(self.process, activity, step, settle=self.flush)
            yield
        finally:
            _work.step = outer
            with self._lock:
                del self._busy[token]
                if not self._busy:
                    self._phase, self._step, self._since = IDLE, None, self._clock()
                self._write()

    def progress(self) -> None:
        """The current phase moved on (e.g. an engine answered); written at most once a second."""
        with self._lock:
            self._progress_at = self._clock()
            if self._progress_at - self._written_at >= PROGRESS_WRITE_S:
                self._write()

    def beat(self) -> Beat:
        """What the file says now (the lock held)."""
        if self._busy:
            activity, since, step = min(self._busy.values(), key=lambda item: item[1])
            phase, busy = activity, True
        else:
            phase, step, since, busy = self._phase, self._step, self._since, False
        progress_at = max(self._progress_at, since)
        return Beat(self.process, self.pid, self._host, phase, step, since, progress_at, busy)

    def _write(self) -> None:
        """Put the beat on disk now, or (behind) have the writer thread do it; the lock is held."""
        if os.getpid() != self.pid:  # a forked child (a worker pool) is not this process
            return
        self._written_at = self._clock()
        if not self._behind:
            _replace(self.path, {**asdict(self.beat()), "written": self._written_at})
            return
        self._unwritten += 1
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_behind, name="dsv4rl-heartbeat", daemon=True)
            self._writer.start()
            atexit.register(self.flush)
        self._changed.notify_all()

    def _write_behind(self) -> None:
        """The writer thread: the newest beat each time one or more were recorded."""
        while True:
            with self._lock:
                self._changed.wait_for(lambda: self._unwritten > 0)
                taken, record = self._unwritten, {**asdict(self.beat()), "written": self._written_at}
            _replace(self.path, record)
            with self._lock:
                self._unwritten -= taken
                self._changed.notify_all()

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every beat recorded so far is on disk (at once when not writing behind)."""
        with self._lock:
            if self._writer is None or not self._writer.is_alive():  # not behind, or a forked child
                return True
            return self._changed.wait_for(lambda: self._unwritten == 0, timeout=timeout_s)


def _replace(path: Path, record: dict[str, Any]) -> None:
    # Not fsynced: a beat matters only while its process lives, and an fsync per phase would put the
    # disk's flush latency on the writer thread (a beat that outlives a machine crash says nothing)
    with contextlib.suppress(OSError):  # a full disk must not stop the run
        write_json_atomic(path, record, durable=False)


_heartbeat: Heartbeat | None = None
_work = threading.local()  # the step of the piece of work (`busy`) this thread is doing


def configure(path: Path, process: str) -> Heartbeat:
    """Make `path` this process's heartbeat (phase `start`); the module functions then write it, behind."""
    global _heartbeat
    _heartbeat = Heartbeat(path, process, behind=True)
    return _heartbeat


def current() -> Heartbeat | None:
    return _heartbeat


def enter(phase: str, step: int | None = None) -> None:
    if _heartbeat is not None:
        _heartbeat.enter(phase, step)


@contextmanager
def busy(activity: str, step: int | None = None) -> Iterator[None]:
    if _heartbeat is None:
        yield
        return
    with _heartbeat.busy(activity, step):
        yield


def reached(point: str) -> None:
    """A named point inside this thread's piece of work (`busy`), at that work's step: where a test can
    make the process hang or die (`dsv4rl.faults.inject`). Nothing else happens here."""
    if _heartbeat is not None:
        maybe_hang(_heartbeat.process, point, getattr(_work, "step", None), settle=_heartbeat.flush)


def progress() -> None:
    if _heartbeat is not None:
        _heartbeat.progress()
