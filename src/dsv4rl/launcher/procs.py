"""Process-tree bookkeeping for the supervisor (Linux /proc), so no descendant outlives a run.

Killing a child's process group is not enough: torchrun starts each worker in a session of its own, and
a child killed by SIGKILL leaves its children behind. The supervisor therefore remembers every
descendant it has seen (pid + start time, so a reused pid is never signalled), signals them directly,
and - as a child subreaper - reaps the orphans that are reparented to it (containers often run a PID 1
that never reaps, which would leave zombies). Reading /proc is `dsv4rl.faults.proc_tree`'s.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable

from dsv4rl.faults.proc_tree import (
    PR_SET_PDEATHSIG,
    Proc,
    descendants,
    prctl,
    process_table,
    read_proc,
)


def child_preexec(death_signal: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A preexec_fn: the child gets `death_signal` if the supervisor dies (even by SIGKILL); torchrun gets
    SIGINT (it ignores SIGTERM, `dsv4rl.train.torchrun`).

    Only from the main thread: the kernel fires PDEATHSIG when the *thread* that forked exits.
    """
    if not hasattr(os, "fork") or threading.current_thread() is not threading.main_thread():
        return None
    parent = os.getpid()
    prctl(0, 0)  # load libc before forking

    def setup() -> None:
        prctl(PR_SET_PDEATHSIG, death_signal)
        if os.getppid() != parent:  # the supervisor died between fork and prctl
            os._exit(1)

    return setup


class Tracker:
    """Every process seen below the supervisor's children: signal them, reap them, tell if any live."""

    def __init__(self) -> None:
        self.seen: dict[int, int] = {}  # pid -> start time
        self.groups: set[int] = set()  # the children's process groups
        self.leaders: set[int] = set()  # reaped by their Popen objects, never here
        self._sent: set[tuple[int, int, int]] = set()

    def add_leader(self, pid: int) -> None:
        self.leaders.add(pid)
        self.groups.add(pid)  # start_new_session: pgid == pid
        proc = read_proc(pid)
        if proc is not None:
            self.seen[pid] = proc.start

    def refresh(self) -> dict[int, Proc]:
        """Remember the current descendants of our children and every member of their groups."""
        table = process_table()
        live_roots = [p for p in self.seen if self._same(p, table)]
        found = descendants(live_roots, table) | {p.pid for p in table.values() if p.pgrp in self.groups}
        found |= self._adopted(table)
        for pid in found:
            self.seen[pid] = table[pid].start
        # Forget emptied groups: their number could later name someone else's group.
        self.groups = {g for g in self.groups if any(p.pgrp == g and p.state != "Z" for p in table.values())}
        return table

    def _adopted(self, table: dict[int, Proc]) -> set[int]:
        """Orphans reparented to us (we are a subreaper) that started after our first child: a descendant
        whose parent died before `refresh` saw it (e.g. a torchrun worker in a session of its own).
        This assumes nothing else in this process starts children while the supervisor runs."""
        starts = [self.seen[pid] for pid in self.leaders if pid in self.seen]
        if not starts:
            return set()
        me, first = os.getpid(), min(starts)
        return {
            p.pid for p in table.values() if p.ppid == me and p.start >= first and p.pid not in self.leaders
        }

    def _same(self, pid: int, table: dict[int, Proc]) -> bool:
        proc = table.get(pid)
        return proc is not None and proc.start == self.seen.get(pid)

    def alive(self, table: dict[int, Proc] | None = None) -> list[int]:
        """Tracked processes still running (zombies count as dead)."""
        table = process_table() if table is None else table
        return [pid for pid in self.seen if self._same(pid, table) and table[pid].state != "Z"]

    def signal_groups(self, sig: int) -> None:
        """`sig` to each child's process group (the child and whatever stayed in its group)."""
        self.refresh()
        for pgid in self.groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, sig)

    def signal_orphans(self, sig: int) -> None:
        """`sig` to tracked processes whose parent is no tracked live process (nobody left to pass a
        signal on: a worker of a killed torchrun, say); each process gets each signal once."""
        table = self.refresh()
        live = set(self.alive(table))
        for pid in live:
            key = (pid, table[pid].start, sig)
            if table[pid].ppid in live or pid in self.leaders or key in self._sent:
                continue
            self._sent.add(key)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def kill_all(self) -> None:
        """SIGKILL every tracked process and group."""
        self.signal_groups(signal.SIGKILL)
        for pid in self.alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def reap(self) -> None:
        """waitpid the tracked orphans reparented to us (not the Popen-owned leaders)."""
        me = os.getpid()
        table = process_table()
        for pid in self.seen:
            proc = table.get(pid)
            if pid in self.leaders or proc is None or proc.ppid != me or proc.start != self.seen[pid]:
                continue
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
