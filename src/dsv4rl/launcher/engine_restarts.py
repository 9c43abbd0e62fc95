"""An engine that dies or hangs is started again while the run goes on (`engine.max_restarts`).

The supervisor owns the processes, so it decides here whether a failed engine of its node is restarted:
with its own command, ports and environment (`ProcessTable.restart`), at most `engine.max_restarts` times
per engine and run. The trainer notices the engine's failure on its own (a request that fails past its
retries, then no answer to /health_generate): it sends that engine's requests to the others, and lets the
restarted engine rejoin the weight-update group at the next sync (`dsv4rl.engine_client.roster`).

An engine that fails again before it ever answered /health_generate after a restart is a restart loop (a
bad node, a port taken, weights that no longer load): it is named and the run stops, whatever budget is
left. Colocated engines are not restarted (they share the trainer's GPUs: `roster.restart_budget`).

An engine whose port another process holds by the time it restarts (an orphan of the dead engine that kept
the socket, anything that bound it meanwhile) is started on a free port instead (`port_for_restart`,
`on_port`): the supervisor records the move (`dsv4rl.faults.engine_ports`) and the trainer follows it.
"""

from __future__ import annotations

import dataclasses
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from dsv4rl.faults.engine_ports import url_with_port
from dsv4rl.launcher.plan import ProcessSpec, port_is_free

__all__ = ["EngineRestarts", "listen_address", "on_port", "port_for_restart"]

HEALTH_PROBE_S = 2.0  # one /health_generate probe of a restarted engine, from the supervisor's watch loop
PORT_RELEASE_S = 5.0  # how long a killed engine's port may take to be free again before it counts as taken


@dataclass
class EngineRestarts:
    """Per engine of this node: how often it was restarted, and whether it answered since. `engines` (the
    run's, every node's) and `min_alive`: an engine whose loss leaves fewer than `min_alive` answering is
    not restarted: the run stops as it did before restarts (one engine: always)."""

    max_restarts: int
    engines: int = 1
    min_alive: int = 1
    counts: dict[str, int] = field(default_factory=dict)
    starting: dict[str, str] = field(default_factory=dict)  # restarted, not yet healthy: name -> health URL

    def refusal(self, name: str, requested: bool = False) -> str | None:
        """Why engine `name` is not restarted (None: restart it). `requested`: the trainer asked for it
        (`dsv4rl.faults.restart_requests`) and waits for it, so the engines answering meanwhile do not
        count against `min_alive`."""
        if self.max_restarts <= 0:
            return "engine.max_restarts=0: an engine failure stops the run"
        if name in self.starting:
            return (
                f"{name} failed again before it answered /health_generate after its restart: a restart loop "
                "(a bad node, a port another process took, weights that no longer load), not retried"
            )
        answering = self.engines - len(self.starting) - 1
        if answering < self.min_alive and not requested:
            return (
                f"without {name}, {answering} engine(s) of the run's {self.engines} answer, fewer than "
                f"engine.min_alive={self.min_alive}"
            )
        if self.counts.get(name, 0) >= self.max_restarts:
            return (
                f"{name} was restarted {self.counts[name]} time(s) already "
                f"(engine.max_restarts={self.max_restarts})"
            )
        return None

    def restarted(self, name: str, health_url: str | None) -> int:
        """Count a restart; returns its number for this engine."""
        self.counts[name] = self.counts.get(name, 0) + 1
        if health_url:
            self.starting[name] = health_url
        return self.counts[name]

    def answered(self) -> list[str]:
        """The restarted engines that answer /health_generate now (each named once)."""
        back = []
        for name, url in list(self.starting.items()):
            try:
                ok = httpx.get(url, timeout=HEALTH_PROBE_S).status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                back.append(name)
                del self.starting[name]
        return back


# ------------------------------------------------------------------------------------- ports on restart
def listen_address(spec: ProcessSpec) -> tuple[str, int] | None:
    """(host, port) of an engine's `--host` and `--port` flags; None when its command has no `--port`."""
    argv = [str(arg) for arg in spec.argv]
    if "--port" not in argv:
        return None
    port = int(argv[argv.index("--port") + 1])
    host = argv[argv.index("--host") + 1] if "--host" in argv else "127.0.0.1"
    return host, port


def port_for_restart(
    spec: ProcessSpec, offsets: Sequence[int] = (), release_s: float | None = None
) -> int | None:
    """A free port for an engine about to restart (its process group killed), or None when its own port
    and the ports it opens above it (`offsets`: SGLang's attention-DP ports) are free again within
    `release_s`. The new port is one the kernel hands out, with its offsets free too."""
    address = listen_address(spec)
    if address is None:
        return None
    host, port = address
    deadline = time.monotonic() + (PORT_RELEASE_S if release_s is None else release_s)
    while True:
        if all(port_is_free(host, port + offset) for offset in (0, *offsets)):
            return None
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("0.0.0.0" if host in ("0.0.0.0", "::") else host, 0))
            candidate = sock.getsockname()[1]
        wanted = [candidate + offset for offset in offsets]
        if max(wanted, default=candidate) <= 65535 and all(port_is_free(host, p) for p in wanted):
            return candidate
    raise OSError(f"no free port with {len(offsets)} free ports above it on {host} for a restart")


def on_port(spec: ProcessSpec, port: int) -> ProcessSpec:
    """`spec` listening on `port`: its `--port` flag, its health URL and the plan's meta."""
    argv = list(spec.argv)
    argv[[str(arg) for arg in argv].index("--port") + 1] = str(port)
    health_url = url_with_port(spec.health_url, port) if spec.health_url else None
    return dataclasses.replace(spec, argv=argv, health_url=health_url, meta={**spec.meta, "port": str(port)})
