"""Whether the engines on other nodes answer over the network: what names a partition between nodes.

Node liveness reads heartbeats in the shared run dir (`dsv4rl.launcher.node_liveness`), so a node cut off
from the network still looks alive there: its supervisor beats on through the filesystem. The trainer
then fails on a request or broadcast timeout (`engine.request_timeout_s`, `sync.timeout_s`) that says
which URL timed out, not why. When the trainer of a multi-node run fails or hangs, the supervisor tries a
TCP connection to each engine on another node; one that gets no answer within a few seconds names its
node and address as the likely cause.
"""

from __future__ import annotations

import concurrent.futures as cf
import socket
from collections.abc import Sequence
from urllib.parse import urlsplit

PROBE_TIMEOUT_S = 3.0


def connect_error(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Why a TCP connection to `host:port` fails (None: it was accepted)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except TimeoutError:
        return f"no answer within {timeout_s:g} s"
    except OSError as error:
        return error.strerror or str(error)


def _node_of(host: str, node_addrs: Sequence[str]) -> int | None:
    return node_addrs.index(host) if host in node_addrs else None


def unreachable_engines(
    remote_engines: Sequence[tuple[str, str]], node_addrs: Sequence[str], timeout_s: float = PROBE_TIMEOUT_S
) -> list[str]:
    """One line per engine on another node (name, any URL of it) that does not accept a connection,
    naming its node (by `cluster.node_addrs`), its address and why; all probed at once."""
    targets = []
    for name, url in remote_engines:
        parts = urlsplit(url)
        if parts.hostname and parts.port:
            targets.append((name, parts.hostname, parts.port))
    if not targets:
        return []
    with cf.ThreadPoolExecutor(max_workers=len(targets)) as pool:
        errors = list(pool.map(lambda t: connect_error(t[1], t[2], timeout_s), targets))
    lines = []
    for (name, host, port), error in zip(targets, errors, strict=True):
        if error is None:
            continue
        node = _node_of(host, node_addrs)
        who = f"node {node} ({host})" if node is not None else host
        if "refused" in error.lower():  # the network answers: nothing listens there any more
            lines.append(f"{who}: nothing listens at {host}:{port}, where {name} served ({error})")
        else:
            lines.append(
                f"{who} cannot be reached from this node: {name} at {host}:{port} does not accept a "
                f"connection ({error}); the network between the nodes is cut or blocked"
            )
    return lines
