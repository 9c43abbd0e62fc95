"""Python stack dumps on request: SIGUSR1 makes a process write every thread's stack to its stacks file.

`faulthandler` writes from its C signal handler, so the dump comes even when the process is stuck in a
collective or holds the GIL in C code, where no Python-level handler would run. The file is opened for
appending and stays open for the process's life; the requester writes a line saying why before it
signals, so each dump in the file follows its reason. Fatal signals (SIGSEGV, SIGABRT, ...) dump the
stacks to stderr, which is the process's log.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TextIO

DUMP_SIGNAL = signal.SIGUSR1
_open_files: list[TextIO] = []  # faulthandler keeps only the descriptor: the file object must live on


def register_stack_dump(path: Path, process: str) -> None:
    """Dump all threads' stacks to `path` on SIGUSR1; fatal errors dump to stderr."""
    stream = Path(path).open("a")  # noqa: SIM115 - open for the process's life
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    stream.write(f"# dsv4rl: {stamp} {process} (pid {os.getpid()}) dumps its Python stacks here on SIGUSR1\n")
    stream.flush()
    _open_files.append(stream)
    faulthandler.register(DUMP_SIGNAL, file=stream, all_threads=True, chain=False)
    with contextlib.suppress(AttributeError, ValueError, OSError):  # stderr without a descriptor
        faulthandler.enable(file=sys.stderr, all_threads=True)


def install_beside_dump(handler: Callable[[int, FrameType | None], None]) -> None:
    """Run a Python `handler` on SIGUSR1 too (a trainer rank's stop request) and keep the stack dump:
    faulthandler writes the stacks from C first, then chains to the handler. Main thread only."""
    if not _open_files:  # no dump registered (run by hand)
        signal.signal(DUMP_SIGNAL, handler)
        return
    faulthandler.unregister(DUMP_SIGNAL)  # a registered dump is not re-installed over a new handler
    signal.signal(DUMP_SIGNAL, handler)
    faulthandler.register(DUMP_SIGNAL, file=_open_files[-1], all_threads=True, chain=True)


def request_dump(pid: int, path: Path, reason: str) -> int | None:
    """Note `reason` in `path`, then ask `pid` for its stacks. Returns the file's size before the dump
    (it has come once the file is larger), or None when the process is gone."""
    size = 0
    with contextlib.suppress(OSError), Path(path).open("a") as stream:
        stream.write(f"\n# dsv4rl: {time.strftime('%Y-%m-%d %H:%M:%S')} stacks requested: {reason}\n")
        stream.flush()
        size = stream.tell()
    try:
        os.kill(pid, DUMP_SIGNAL)
    except (ProcessLookupError, PermissionError):
        return None
    return size
