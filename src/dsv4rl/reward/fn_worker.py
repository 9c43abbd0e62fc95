"""A reward worker process: `python -m dsv4rl.reward.fn_worker FD` (started by `fn_pool.AsyncProcessPool`).

It imports only what a reward needs (never the trainer's modules: a restart after a timeout costs an
interpreter start and the user's imports, not torch's), reads the targets to load from the pipe `FD`,
says ready, then runs chunks of calls, sending each result back as soon as it has it.

The process the pool starts (in a session of its own) is a reaper: a child subreaper that forks the
worker and waits. Every process the user's code starts stays its descendant, even one that calls setsid
and whose parent exits (an orphan is reparented to the reaper, not to PID 1), so the pool can find and
kill them all (`faults.proc_tree.kill_descendants`); the reaper reaps those orphans as they end (no
zombies pile up in a long run) and, when the worker ends for any reason, kills what is left and exits
with the worker's code. Where a subreaper cannot be had (not Linux), the worker runs in that process
itself and the pool's kill reaches its process group and its descendants as they are.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from dsv4rl.faults.proc_tree import become_subreaper, kill_descendants
from dsv4rl.reward.results import call_failed
from dsv4rl.targets import Target, resolve

_FUNCTIONS: dict[Target, Callable[..., Any]] = {}


def call_target(target: Target, payload: Any, kwargs: dict[str, Any]) -> Any:
    """The user's function on one sample (or one group's samples)."""
    function = _FUNCTIONS.get(target)
    if function is None:
        function = _FUNCTIONS[target] = resolve(target)
    result = function(payload, **kwargs)
    if asyncio.iscoroutine(result):
        result.close()
        raise TypeError(f"{target.spec} returned a coroutine: an async function must be declared `async def`")
    return result


class _CallTimeout(BaseException):
    """Raised by the call's alarm; a BaseException so that `except Exception` in the callee cannot eat it."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise _CallTimeout


def _run(fn: Callable[..., Any], args: tuple, alarm_s: float | None) -> Any:
    """fn(*args); with `alarm_s`, stopped by SIGALRM that long after (this runs on the main thread)."""
    if alarm_s is None:
        return fn(*args)
    signal.setitimer(signal.ITIMER_REAL, alarm_s)
    try:
        return fn(*args)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def serve(conn: Connection) -> None:
    """A worker's life: load the targets, say ready, then run chunks until told to stop."""
    try:
        for target in conn.recv():
            _FUNCTIONS[target] = resolve(target)
    except Exception as error:
        conn.send(("init_error", call_failed(error)))
        return
    signal.signal(signal.SIGALRM, _on_alarm)
    conn.send(("ready", os.getpid()))  # the pool learns whether a reaper is above it
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        if chunk is None:
            return
        for call_id, fn, args, alarm_s in chunk:
            try:
                out = (call_id, "ok", _run(fn, args, alarm_s))
            except _CallTimeout:
                out = (call_id, "timeout", None)
            except Exception as error:
                out = (call_id, "error", call_failed(error))
            try:
                conn.send(out)
            except Exception as error:  # a result that cannot be pickled
                conn.send((call_id, "error", call_failed(error)))


def reap(worker: int) -> int:
    """The reaper's life: reap every child (the worker, and the orphans of its tree reparented here) until
    the worker ends; then kill and reap what is left of its tree. Returns the worker's exit code."""
    code = 1
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            return code
        if pid == worker:
            code = os.waitstatus_to_exitcode(status)
            code = 128 - code if code < 0 else code  # killed by a signal: the shell's 128 + N
            kill_descendants(os.getpid())
            while True:  # the killed ones, reparented here as their parents die
                try:
                    os.wait()
                except ChildProcessError:
                    return code


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's business
    fd = int(sys.argv[1])
    if become_subreaper():
        worker = os.fork()
        if worker:
            os.close(fd)  # the worker holds the only end: the pool sees EOF when it dies
            sys.exit(reap(worker))
    sock = socket.socket(fileno=fd)
    serve(Connection(sock.detach()))


if __name__ == "__main__":
    main()
