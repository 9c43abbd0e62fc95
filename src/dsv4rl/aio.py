"""Running a coroutine on an event loop from blocking code, whether that loop is idle or running on a
thread of its own (`algo.max_staleness` >= 2 keeps rank 0's loop generating for the whole run)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_on(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> T:
    """`coro`'s result: run to completion on `loop` here when it is idle, else handed to the thread that
    runs it and waited for (it then runs beside that thread's own work)."""
    if not loop.is_running():
        return loop.run_until_complete(coro)
    try:
        running_here = asyncio.get_running_loop() is loop
    except RuntimeError:
        running_here = False
    if running_here:
        coro.close()
        raise RuntimeError("run_on was called from a coroutine of the loop it would block")
    return asyncio.run_coroutine_threadsafe(coro, loop).result()
