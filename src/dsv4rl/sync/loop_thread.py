"""An asyncio event loop in a daemon thread: lets blocking code (the trainer) drive async clients."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import threading
from collections.abc import Coroutine, Sequence
from typing import Any

log = logging.getLogger("dsv4rl.sync")


class LoopThread:
    """An asyncio loop running in a daemon thread, for the engines' HTTP calls."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="dsv4rl-weight-sync-http", daemon=True
        )
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, Any]) -> cf.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self, cleanup: Sequence[Coroutine[Any, Any, Any]] = ()) -> None:
        if cleanup:

            async def run_cleanup() -> None:
                await asyncio.wait_for(asyncio.gather(*cleanup, return_exceptions=True), 10)

            future = self.submit(run_cleanup())
            try:
                future.result(timeout=15)
            except Exception:  # closing connections is best effort
                log.debug("closing engine HTTP clients failed", exc_info=True)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()
