"""Where a restarted engine listens when its planned port was taken.

An engine is restarted with its own command and ports. When another process holds its port by then (an
orphan of the dead engine that kept the socket, anything that bound it meanwhile), its supervisor starts it
on a free port instead and says so here, in the run's log directory, which every node shares (as the
heartbeats and the restart requests do): `port-<engine>.json`, `{"port": int, "was": int}`. The
trainer's rank 0 reads it before it asks a lost engine whether it answers again, and follows it; the other
pipeline stages' senders learn the engine's address from rank 0 with the group's new members. The host
stays the node's: only the port moves.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from dsv4rl.faults.files import read_json, write_json_atomic

__all__ = ["clear", "moved_port", "record_move", "url_with_port"]


def _path(log_dir: Path | str, name: str) -> Path:
    return Path(log_dir) / f"port-{name}.json"


def record_move(log_dir: Path | str, name: str, port: int, was: int) -> None:
    """Engine `name` now listens on `port` (it listened on `was`)."""
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    write_json_atomic(_path(log_dir, name), {"port": port, "was": was})


def moved_port(log_dir: Path | str, name: str) -> int | None:
    """The port engine `name` moved to, or None while it listens where the plan put it."""
    port = (read_json(_path(log_dir, name)) or {}).get("port")
    return port if isinstance(port, int) else None


def clear(log_dir: Path | str, name: str) -> None:
    """At a launch: engines start on their planned ports again."""
    with contextlib.suppress(FileNotFoundError):
        _path(log_dir, name).unlink()


def url_with_port(url: str, port: int) -> str:
    """`url` (an engine's base or health URL) with its port replaced by `port`."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition(":")[0] if parts.port is not None else parts.netloc
    return urlunsplit(parts._replace(netloc=f"{host}:{port}"))
