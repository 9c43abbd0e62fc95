"""The one call a child process makes at start: `with child_process("trainer", rank=r): main()`.

When the supervisor started the process (it sets `DSV4RL_LOG_DIR` and `DSV4RL_PROCESS_NAME`), this
registers the SIGUSR1 stack dump, writes the first heartbeat (phase `start`), sends notices to the
supervisor's console and turns an exception that leaves the block into a crash report, all under
`<log dir>/<kind>-<process>`. Run by hand (no such environment), it does nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dsv4rl.faults import heartbeat, notices
from dsv4rl.faults.crash_report import crash_report
from dsv4rl.faults.files import CRASH, HEARTBEAT, LOG_DIR_ENV, NOTICE, PROCESS_ENV, STACKS, fault_file
from dsv4rl.faults.inject import maybe_hang
from dsv4rl.faults.stacks import register_stack_dump


def process_name(default: str, rank: int | None = None) -> str:
    """The name the supervisor gave this process (else `default`), with `-rank<r>` for a torchrun rank."""
    name = os.environ.get(PROCESS_ENV) or default
    return name if rank is None else f"{name}-rank{rank}"


@contextmanager
def child_process(default_name: str, *, rank: int | None = None) -> Iterator[str | None]:
    """Yields the process's name, or None when no supervisor started it."""
    log_dir = os.environ.get(LOG_DIR_ENV)
    if not log_dir:
        yield None
        return
    name = process_name(default_name, rank)
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    register_stack_dump(fault_file(log_dir, STACKS, name), name)  # before the heartbeat names our pid
    with crash_report(fault_file(log_dir, CRASH, name), name):
        heartbeat.configure(fault_file(log_dir, HEARTBEAT, name), name)
        notices.configure(fault_file(log_dir, NOTICE, name), name)
        maybe_hang(name, heartbeat.START)
        yield name
