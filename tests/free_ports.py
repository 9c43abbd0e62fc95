"""Free local ports for tests that start servers or plan runs."""

from __future__ import annotations

import contextlib
import socket


def free_ports(count: int) -> list[int]:
    """`count` distinct ports, held open together until all are chosen: asked one at a time, the kernel
    may hand the same ephemeral port out twice (a run planned on it then refuses a port planned twice)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


def free_port() -> int:
    return free_ports(1)[0]


def port_overrides() -> list[str]:
    """The recipe keys of a run's three base ports, free now and far enough apart that no engine's port
    (engine.port + its index) lands on the torchrun master or the weight-sync port."""
    while True:
        engine, master, weight_sync = free_ports(3)
        if all(abs(port - engine) > 16 for port in (master, weight_sync)):
            return [
                f"engine.port={engine}",
                f"cluster.master_port={master}",
                f"cluster.weight_sync_port={weight_sync}",
            ]
