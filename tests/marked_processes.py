"""Processes found by a marker in their argv (/proc): what the reward tests start and must see die."""

from __future__ import annotations

from pathlib import Path

from dsv4rl.faults.proc_tree import process_table


def running_with(marker: str) -> list[int]:
    """Live processes (zombies left out) with `marker` as one of their arguments."""
    found = []
    for pid, proc in process_table().items():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker.encode() in argv and proc.state not in ("Z", "X"):
            found.append(pid)
    return found
