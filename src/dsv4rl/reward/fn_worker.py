"""A reward worker process: `python -m dsv4rl.reward.fn_worker FD` (started by `fn_pool.AsyncProcessPool`).

It imports only what a reward needs (never the trainer's modules: a restart after a timeout costs an
interpreter start and the user's imports, not torch's), reads the targets to load from the pipe `FD`,
says ready, then runs chunks of calls, sending each result back as soon as it has it.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from dsv4rl.reward.targets import Target, load_function
from dsv4rl.reward.verify_pool import call_failed

_FUNCTIONS: dict[Target, Callable[..., Any]] = {}


def call_target(target: Target, payload: Any, kwargs: dict[str, Any]) -> Any:
    """The user's function on one sample (or one group's samples)."""
    function = _FUNCTIONS.get(target)
    if function is None:
        function = _FUNCTIONS[target] = load_function(target)
    result = function(payload, **kwargs)
    if asyncio.iscoroutine(result):
        result.close()
        raise TypeError(f"{target.spec} returned a coroutine: an async function must be declared `async def`")
    return result


def serve(conn: Connection) -> None:
    """A worker's life: load the targets, say ready, then run chunks until told to stop."""
    try:
        for target in conn.recv():
            _FUNCTIONS[target] = load_function(target)
    except Exception as error:
        conn.send(("init_error", call_failed(error)))
        return
    conn.send(("ready", None))
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        if chunk is None:
            return
        for call_id, fn, args in chunk:
            try:
                out = (call_id, "ok", fn(*args))
            except Exception as error:
                out = (call_id, "error", call_failed(error))
            try:
                conn.send(out)
            except Exception as error:  # a result that cannot be pickled
                conn.send((call_id, "error", call_failed(error)))


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's business
    sock = socket.socket(fileno=int(sys.argv[1]))
    serve(Connection(sock.detach()))


if __name__ == "__main__":
    main()
