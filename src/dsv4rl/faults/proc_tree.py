"""Linux /proc reading for process trees: who descends from whom, and killing a whole tree.

Shared by the supervisor (`dsv4rl.launcher.procs`, which keeps no descendant of a run alive) and the reward
worker pool (`dsv4rl.reward.fn_pool`, which keeps no descendant of a killed worker alive). Stdlib only:
the reward workers import it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
_libc = None


def prctl(option: int, value: int) -> bool:
    """prctl(2) through libc; False where it fails or there is none (not Linux)."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        return _libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def become_subreaper() -> bool:
    """Orphaned descendants get reparented to this process, not to PID 1: they stay its descendants."""
    return prctl(PR_SET_CHILD_SUBREAPER, 1)


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    pgrp: int
    state: str  # R, S, D, Z, ...
    start: int  # start time in clock ticks since boot: (pid, start) names one process forever


def read_proc(pid: int) -> Proc | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # comm may contain spaces and parentheses: fields start after the last ')'
    rest = raw[raw.rindex(")") + 2 :].split()
    return Proc(pid=pid, ppid=int(rest[1]), pgrp=int(rest[2]), state=rest[0], start=int(rest[19]))


def process_table() -> dict[int, Proc]:
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            proc = read_proc(int(entry))
            if proc is not None:
                table[proc.pid] = proc
    return table


def descendants(roots: Iterable[int], table: dict[int, Proc]) -> set[int]:
    children: dict[int, list[int]] = {}
    for proc in table.values():
        children.setdefault(proc.ppid, []).append(proc.pid)
    found: set[int] = set()
    stack = list(roots)
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def live_descendants(pid: int) -> list[int]:
    """`pid`'s descendants that still run (zombies left out)."""
    table = process_table()
    return [p for p in descendants([pid], table) if table[p].state not in ("Z", "X")]


def kill_descendants(pid: int, within_s: float = 2.0) -> list[int]:
    """SIGKILL every live descendant of `pid`, the ones that left its process group or session included,
    until a scan finds none (or `within_s` has passed): a process that forks while the others die is found
    by the next scan, and an orphan stays a descendant when `pid` is a child subreaper. Returns what lives
    on (nothing, unless a process ignores SIGKILL for `within_s`: one in uninterruptible sleep)."""
    if not os.path.isdir("/proc"):
        return []
    deadline = time.monotonic() + within_s
    while True:
        live = live_descendants(pid)
        if not live or time.monotonic() > deadline:
            return live
        for child in live:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(child, signal.SIGKILL)
        time.sleep(0.005)


def kill_group(pgid: int) -> None:
    """SIGKILL a process group (a process started with start_new_session: pgid == its pid), if any is left."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
