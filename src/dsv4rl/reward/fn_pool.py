"""Every call into user or grader code (sync reward functions, the graders of eval and math-verify) in worker
processes, each call under its own deadline, awaited from asyncio.

Why this shape (the failures peers' users report, docs/tasks.md): a reward call never runs in the trainer's
process (a hang there stalls the step), and a timeout is never a signal in the caller or the worker
(`signal.alarm` only works on a main thread, and a C loop ignores it). Each worker is a process of its own
with a pipe to the trainer's event loop: it gets a chunk of calls, runs them one after the other and sends
each result back as soon as it has it. The loop knows when each call started (when the chunk was sent, or
when the previous result came back) and holds its deadline; a call past its deadline gets its worker
killed and a fresh one started, the rest of that worker's chunk goes back to the queue, and only the slow
call is lost (`TIMED_OUT`). A worker that dies by itself (a segfault, `os._exit`) gives its call one more
try, then the call fails as `WorkerDied`. A call may also ask for its worker's own alarm (`grace_s`: a
grader's call): SIGALRM stops it at its timeout and the worker goes on (no restart for a Python-level
loop); only a call the alarm cannot stop (a long C call) is killed, `grace_s` later.

Chunks keep the cost per call low (one message per call back, one per chunk out: a 512-sample step of a
cheap function costs milliseconds). A worker is a fresh interpreter (`python -m dsv4rl.reward.fn_worker`,
the trainer's import path and working directory) that never imports the trainer's modules (a restart
costs its own imports, not torch's), and imports the user's reward modules before it says it is ready, so
no deadline pays for an import.

No process a reward function starts outlives its worker: a worker runs in a session of its own under a
reaper (a child subreaper, `fn_worker`), and a worker is never stopped gently: a timeout, a death, a
replacement and `close` all kill every descendant of the reaper (those that called setsid, or whose
parent exited, included), then its process group (`_end`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from dsv4rl.faults.proc_tree import kill_descendants, kill_group
from dsv4rl.reward.results import TIMED_OUT, CallFailed
from dsv4rl.targets import Target

log = logging.getLogger(__name__)

CHUNK_MAX = 16  # calls sent to a worker at once
REAPER_EXIT_S = 2.0  # a reaper exits as soon as its worker is dead and its orphans are reaped


def _child_env() -> dict[str, str]:
    """The worker's environment: this process's, with its import path (the user's modules import the same)."""
    paths = [p if p else os.getcwd() for p in sys.path]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}


# ------------------------------------------------------------------------------------------- the pool
@dataclass
class _Call:
    id: int
    fn: Callable[..., Any]
    args: tuple
    timeout_s: float
    future: asyncio.Future
    grace_s: float | None = None  # set: the worker's alarm stops the call at timeout_s, the kill comes later
    deaths: int = 0

    @property
    def alarm_s(self) -> float | None:
        """When the worker's own alarm stops the call (None: no alarm, the pool's kill only)."""
        return None if self.grace_s is None else self.timeout_s

    @property
    def deadline_s(self) -> float:
        """When the pool kills the call's worker, from the call's start."""
        return self.timeout_s + (self.grace_s or 0.0)


@dataclass
class _Worker:
    process: subprocess.Popen
    conn: Connection
    ready: bool = False
    chunk: collections.deque = field(default_factory=collections.deque)  # calls sent, not answered yet
    timer: asyncio.TimerHandle | None = None
    started_at: float = field(default_factory=time.monotonic)
    serving: int | None = None  # the pid that runs the calls (ready says): below a reaper, or the process


def _end(worker: _Worker) -> None:
    """Kill a worker and every process it started; return once none of them runs."""
    process = worker.process
    reaped = worker.serving is not None and worker.serving != process.pid
    if not reaped:  # no reaper (or not ready): stop the worker so that it starts nothing more meanwhile
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(process.pid, signal.SIGSTOP)
    kill_descendants(process.pid)
    if reaped:  # it reaps the killed, then exits
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=REAPER_EXIT_S)
    kill_group(process.pid)  # what is left of its session's group, the process itself included
    if process.poll() is None:
        process.kill()
    process.wait(timeout=5)


class AsyncProcessPool:
    """`await pool.call(fn, args, timeout_s)` -> fn's value, TIMED_OUT or CallFailed (from one event loop)."""

    def __init__(
        self,
        num_workers: int,
        targets: Sequence[Target] = (),
        label: str = "reward",
        startup_timeout_s: float = 120.0,
        chunk_max: int = CHUNK_MAX,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1 (reward.num_workers), got {num_workers}")
        self.num_workers = num_workers
        self.targets = tuple(targets)
        self.label = label
        self.startup_timeout_s = startup_timeout_s
        self.chunk_max = max(1, chunk_max)
        self.restarts = 0  # workers killed: a call past its deadline, or a worker that died
        self.timeouts = 0
        self._ids = itertools.count()
        self._pending: collections.deque[_Call] = collections.deque()
        self._workers: list[_Worker] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._failure: CallFailed | None = None  # workers that cannot start: every call fails with it

    # ------------------------------------------------------------------ calls
    async def call(
        self, fn: Callable[..., Any], args: tuple, timeout_s: float, grace_s: float | None = None
    ) -> Any:
        """fn(*args) in a worker within `timeout_s` seconds of starting: its value, TIMED_OUT, or CallFailed
        (it raised, its result could not come back, or its worker died twice). With `grace_s`, the worker's
        alarm stops the call at `timeout_s` and its worker is killed only if it has not answered
        `grace_s` later."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._adopt(loop)
        if self._failure is not None:
            return self._failure
        future = loop.create_future()
        self._pending.append(_Call(next(self._ids), fn, args, timeout_s, future, grace_s))
        self._pump()
        return await future

    async def start(self) -> None:
        """Start the workers now and wait until each has imported the reward modules (before the first
        step, so that no step pays for it); a worker that cannot start raises RuntimeError."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._adopt(loop)
        while self._failure is None and not all(w.ready for w in self._workers):
            await asyncio.sleep(0.02)
        if self._failure is not None:
            raise RuntimeError(f"{self.label} workers: {self._failure.message}\n{self._failure.traceback}")

    def _adopt(self, loop: asyncio.AbstractEventLoop) -> None:
        """Serve from `loop` (the first call; or the workers of another loop are dropped)."""
        self.close()
        self._loop = loop
        self._workers = [self._spawn() for _ in range(self.num_workers)]

    # ------------------------------------------------------------------ workers
    def _spawn(self) -> _Worker:
        ours, theirs = socket.socketpair()
        process = subprocess.Popen(
            [sys.executable, "-m", "dsv4rl.reward.fn_worker", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            env=_child_env(),
            start_new_session=True,  # its own process group: `_end` kills the group, and Ctrl-C is ours
        )
        theirs.close()
        parent = Connection(ours.detach())
        parent.send(list(self.targets))
        worker = _Worker(process, parent)
        self._loop.add_reader(parent.fileno(), self._readable, worker)
        worker.timer = self._loop.call_later(self.startup_timeout_s, self._start_expired, worker)
        return worker

    def _replace(self, worker: _Worker) -> None:
        """Kill `worker` and start a fresh one in its place."""
        self._stop(worker)
        self.restarts += 1
        if self._failure is None:
            self._workers[self._workers.index(worker)] = self._spawn()

    def _stop(self, worker: _Worker) -> None:
        """Kill `worker` with every process it started (`_end`)."""
        if worker.timer is not None:
            worker.timer.cancel()
        with contextlib.suppress(OSError, ValueError, RuntimeError):  # closed already
            self._loop.remove_reader(worker.conn.fileno())
        worker.conn.close()
        _end(worker)

    def _start_expired(self, worker: _Worker) -> None:
        if not worker.ready:
            why = f"a {self.label} worker did not start within {self.startup_timeout_s:g} s (its imports)"
            self._fail_all(CallFailed("WorkerStartFailed", why))

    def _fail_all(self, failure: CallFailed) -> None:
        """Workers cannot start: every call, now and later, fails with `failure`."""
        self._failure = failure
        for worker in self._workers:
            for call in worker.chunk:
                _resolve(call, failure)
            worker.chunk.clear()
            self._stop(worker)
        while self._pending:
            _resolve(self._pending.popleft(), failure)
        log.error("%s: %s", failure.error_type, failure.message)

    def _readable(self, worker: _Worker) -> None:
        while True:
            try:
                if not worker.conn.poll():
                    return
                message = worker.conn.recv()
            except (EOFError, OSError):
                self._died(worker)
                return
            if message[0] == "ready":
                worker.ready, worker.serving = True, message[1]
                worker.timer.cancel()
                worker.timer = None
                self._pump()
            elif message[0] == "init_error":
                self._fail_all(message[1])
                return
            else:
                self._answered(worker, *message)

    def _answered(self, worker: _Worker, call_id: int, status: str, value: Any) -> None:
        call = worker.chunk.popleft()
        assert call.id == call_id, (call.id, call_id)
        if status == "timeout":  # its worker's alarm stopped it
            self.timeouts += 1
            log.warning("%s call took over %.1f s: its worker's alarm stopped it", self.label, call.timeout_s)
            value = TIMED_OUT
        _resolve(call, value)  # status "error": a CallFailed
        self._arm(worker)

    def _arm(self, worker: _Worker) -> None:
        """The next call of the worker's chunk starts now: hold its deadline; an idle worker takes more."""
        if worker.timer is not None:
            worker.timer.cancel()
            worker.timer = None
        if worker.chunk:
            call = worker.chunk[0]
            worker.timer = self._loop.call_later(call.deadline_s, self._expired, worker, call.id)
        else:
            self._pump()

    def _expired(self, worker: _Worker, call_id: int) -> None:
        if not worker.chunk or worker.chunk[0].id != call_id:
            return
        call = worker.chunk.popleft()
        self.timeouts += 1
        log.warning(
            "%s call took over %.1f s%s: its worker was killed and restarted",
            self.label, call.timeout_s, "" if call.grace_s is None else " and did not stop at its alarm",
        )  # fmt: skip
        _resolve(call, TIMED_OUT)
        self._pending.extendleft(reversed(worker.chunk))  # the rest of its chunk runs again elsewhere
        worker.chunk.clear()
        self._replace(worker)
        self._pump()

    def _died(self, worker: _Worker) -> None:
        if not worker.ready:  # died while importing the reward modules: it would again
            code = worker.process.poll()
            why = f"a {self.label} worker died starting (exit code {code}); does each reward module import?"
            self._fail_all(CallFailed("WorkerStartFailed", why))
            return
        if worker.chunk:
            call = worker.chunk.popleft()
            call.deaths += 1
            if call.deaths >= 2:
                _resolve(call, CallFailed("WorkerDied", "the worker process died twice running this call"))
            else:
                self._pending.appendleft(call)
            self._pending.extendleft(reversed(worker.chunk))
            worker.chunk.clear()
        self._replace(worker)
        self._pump()

    def _pump(self) -> None:
        """Send chunks to idle ready workers: an even share of the queue, at most `chunk_max` calls."""
        for worker in self._workers:
            while self._pending and self._pending[0].future.done():  # its caller went away
                self._pending.popleft()
            if not self._pending:
                return
            if not worker.ready or worker.chunk:
                continue
            share = -(-len(self._pending) // self.num_workers)
            chunk = []
            while self._pending and len(chunk) < min(self.chunk_max, share):
                call = self._pending.popleft()
                if not call.future.done():
                    chunk.append(call)
            if not chunk:
                continue
            worker.chunk.extend(chunk)
            try:
                worker.conn.send([(c.id, c.fn, c.args, c.alarm_s) for c in chunk])
            except OSError:
                self._died(worker)
                return
            self._arm(worker)

    def close(self) -> None:
        """Kill the workers and whatever they started (calls still waiting get nothing more)."""
        for worker in self._workers:
            self._stop(worker)
        self._workers = []


def _resolve(call: _Call, value: Any) -> None:
    if not call.future.done():
        call.future.set_result(value)
