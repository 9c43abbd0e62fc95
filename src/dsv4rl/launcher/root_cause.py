"""Why a child failed, in its own words: its crash report, or the rank and signal torchrun saw.

A failed trainer's log ends with torchrun's ChildFailedError block, which says which rank failed but
not why; the exception is in the rank's crash report (`dsv4rl.faults.crash_report`). A rank killed by
a signal writes nothing, so its rank, pid and signal come from torchrun's block (`rank : 1 (local_rank:
1)` / `exitcode : -9 (pid: 1234)`, the format of torch 2.x).

Which failure is the root cause: a rank killed by a signal other than SIGTERM/SIGINT (SIGKILL, SIGSEGV,
...: ranks that lose a peer raise a connection error afterwards, never the other way round), then the
earliest exception, then what torchrun names. torchrun stops the other ranks with SIGTERM and lists them
too; those are left out.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field
from pathlib import Path

from dsv4rl.faults.crash_report import CrashReport, read_crash_report
from dsv4rl.faults.files import CRASH, HEARTBEAT, fault_file, files_of
from dsv4rl.faults.heartbeat import read_beat
from dsv4rl.launcher.watchdog import where

ROOT_CAUSE_TITLE = "Root Cause (first observed failure):"
_FAILURE = re.compile(
    r"rank\s*:\s*(?P<rank>\d+)\s*\(local_rank:\s*(?P<local>\d+)\)\s*\n"
    r"\s*exitcode\s*:\s*(?P<code>-?\d+)\s*\(pid:\s*(?P<pid>\d+)\)"
)


@dataclass(frozen=True)
class RankExit:
    """A failed rank as torchrun reports it."""

    rank: int
    local_rank: int
    exitcode: int
    pid: int

    def describe(self, child: str, log_dir: Path | None = None) -> str:
        """What happened to the rank, and in which phase when its heartbeat (in `log_dir`) says."""
        name = f"{child}-rank{self.rank}"
        beat = read_beat(fault_file(log_dir, HEARTBEAT, name)) if log_dir is not None else None
        during = f" during {where(beat)}" if beat is not None and beat.pid == self.pid else ""
        if self.exitcode >= 0:
            return (
                f"{name} (pid {self.pid}) exited with code {self.exitcode}{during} without a Python exception"
            )
        try:
            sig = signal.Signals(-self.exitcode).name
        except ValueError:
            sig = f"signal {-self.exitcode}"
        hint = " (often the kernel's out-of-memory killer: see dmesg)" if sig == "SIGKILL" else ""
        return f"{name} (pid {self.pid}) was killed by {sig}{during}{hint}"


@dataclass(frozen=True)
class RootCause:
    process: str
    headline: str  # "trainer-rank0: ValueError: boom (at src/dsv4rl/x.py:3 in f)"
    traceback: str | None = None  # the exception's traceback; None for a signal
    source: Path | None = None  # the crash report
    others: list[str] = field(default_factory=list)  # further failures of the same child, one line each


def torchrun_failures(log_text: str) -> list[RankExit]:
    """The ranks of torchrun's last failure block in `log_text`, its root cause first."""
    root_at = log_text.rfind(ROOT_CAUSE_TITLE)
    if root_at < 0:
        return []
    start = log_text.rfind("Failures:", 0, root_at)
    start = root_at if start < 0 else start

    def exits(text: str) -> list[RankExit]:
        return [
            RankExit(int(m["rank"]), int(m["local"]), int(m["code"]), int(m["pid"]))
            for m in _FAILURE.finditer(text)
        ]

    root = exits(log_text[root_at:])[:1]
    return root + [e for e in exits(log_text[start:root_at]) if e not in root]


def crash_reports(log_dir: Path, child: str) -> list[tuple[CrashReport, Path]]:
    """The crash reports of `child` and its ranks, earliest first."""
    found = [
        (report, path) for path in files_of(log_dir, CRASH, child) if (report := read_crash_report(path))
    ]
    return sorted(found, key=lambda item: item[0].time)


STOP_SIGNALS = (-signal.SIGTERM, -signal.SIGINT)  # how torchrun (or the supervisor) stops ranks


def find_root_cause(log_dir: Path, child: str, log_text: str) -> RootCause | None:
    """The root cause of `child`'s failure from its crash reports and torchrun's block in its log."""
    crashes = crash_reports(log_dir, child)
    crashed = {report.process for report, _ in crashes}
    exits = [e for e in torchrun_failures(log_text) if f"{child}-rank{e.rank}" not in crashed]
    killed = [e for e in exits if e.exitcode < 0 and e.exitcode not in STOP_SIGNALS]
    lines = [f"{report.process}: {report.headline()}" for report, _ in crashes]
    if killed or (exits and not crashes):
        root = (killed or exits)[0]
        rest = [e.describe(child) for e in exits if e is not root and e.exitcode not in STOP_SIGNALS]
        return RootCause(f"{child}-rank{root.rank}", root.describe(child, log_dir), others=lines + rest)
    if crashes:
        (report, path), *_ = crashes
        rest = [e.describe(child) for e in exits if e.exitcode not in STOP_SIGNALS]
        return RootCause(report.process, lines[0], report.traceback, path, lines[1:] + rest)
    return None
