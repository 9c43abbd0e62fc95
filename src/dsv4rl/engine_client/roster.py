"""Which of the run's engines take requests now, as the trainer's rank 0 sees them.

An engine is lost when a call to it failed past the client's retries and it then does not answer
/health_generate within `engine.health_timeout_s` (a dead process, a node gone, an engine killed by its
supervisor after it hung). Its call is sent again to a live engine (`reroute`): a /generate call returns
all its samples or none, so no sample generated in part by the lost engine is ever kept, and its groups
stay whole. Its node's supervisor restarts it (`dsv4rl.launcher.engine_restarts`); at each weight sync the
trainer asks the lost engines whether they answer again and rebuilds the weight-update group with every
engine that does (`members_for_sync`): a group with a dead member cannot be used again. A rejoined
engine takes requests only after the sync that gave it the current weights, and its log-prob probe,
passed. An engine restarted on another port (its own was taken: `dsv4rl.faults.engine_ports`) is
followed there before it is asked. Fewer live engines than `engine.min_alive` stops the run
(`EnginesLost`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from pathlib import Path

from dsv4rl.config.schema import Config
from dsv4rl.engine_client.client import EngineClient, EngineError
from dsv4rl.faults import heartbeat
from dsv4rl.faults.engine_ports import moved_port, url_with_port
from dsv4rl.faults.restart_requests import read_answer, request_restart

__all__ = ["EngineRoster", "EnginesLost", "restart_budget"]

log = logging.getLogger("dsv4rl.rollout")
RETURN_PROBE_S = 5.0  # how long a lost engine may take to answer, at a sync, to count as back
ANSWER_WAIT_S = 60.0  # how long the supervisors may take to answer a restart request (they poll each second)


class EnginesLost(RuntimeError):
    """Fewer engines answer than `engine.min_alive`: the run cannot go on."""


def restart_budget(cfg: Config) -> int:
    """Restarts per engine and run: `engine.max_restarts`; 0 for colocated engines, which share the
    trainer's GPUs (a restart would load a second model copy beside the trainer's; docs/faults.md)."""
    return 0 if cfg.parallel.colocate else cfg.engine.max_restarts


class EngineRoster:
    """`clients`: every engine of the run, in the topology's order (the weight-update group's rank order).
    `log_dir`: the run's, where the supervisors say which engines moved to another port."""

    def __init__(
        self,
        clients: Sequence[EngineClient],
        *,
        min_alive: int,
        health_timeout_s: float,
        log_dir: Path | str | None = None,
    ) -> None:
        self.clients = list(clients)
        self.min_alive = min_alive
        self.health_timeout_s = health_timeout_s
        self.log_dir = None if log_dir is None else Path(log_dir)
        self.down: set[int] = set()  # lost, not yet rejoined
        self.members = list(range(len(self.clients)))  # the engines in the weight-update group
        self.restarts = 0  # engines that came back and rejoined
        self.resent = 0  # /generate calls (or trajectories) sent again to another engine
        self._probes: dict[int, asyncio.Future[bool]] = {}  # health probes in flight, by engine
        self.names = [f"engine-{index}" for index in range(len(self.clients))]  # the plan's, by global index

    @classmethod
    def from_config(cls, cfg: Config, clients: Sequence[EngineClient]) -> EngineRoster:
        return cls(
            clients,
            min_alive=cfg.engine.min_alive,
            health_timeout_s=cfg.engine.health_timeout_s,
            log_dir=Path(cfg.run.dir) / "logs",
        )

    def live(self) -> list[EngineClient]:
        return [self.clients[index] for index in self.live_indices()]

    def metrics(self) -> dict[str, int]:
        return {
            "engine/restarts": self.restarts,
            "engine/alive": len(self.live()),
            "rollout/resent": self.resent,
        }

    # ------------------------------------------------------------------------------ during a rollout
    async def reroute(self, client: EngineClient, error: BaseException) -> EngineClient | None:
        """After `error` on a call to `client`: the live engine to send the call to instead when `client`
        is lost, else None (the error is the call's own: the caller raises it)."""
        if not isinstance(error, EngineError) or client not in self.clients:
            return None
        index = self.clients.index(client)
        if index not in self.down and await self._answers(index):
            return None  # it answers: the failure is the request's, not the engine's
        if index not in self.down:  # the first of the calls that failed together says so
            self.down.add(index)
            log.warning(
                "engine %s is lost (%s; no answer to /health_generate within engine.health_timeout_s=%g s): "
                "its requests go to the other engines until it rejoins",
                client.base_url,
                error,
                self.health_timeout_s,
            )
        live = self.live()
        if len(live) < self.min_alive:  # min_alive >= 1: validated
            raise EnginesLost(self._too_few(len(live)))
        self.resent += 1
        return min(live, key=lambda c: c.in_flight)

    async def _answers(self, index: int) -> bool:
        """One /health_generate probe of engine `index`, shared by every call that failed on it meanwhile
        (a dead engine fails all its calls at once: one probe, one warning)."""
        probe = self._probes.get(index)
        if probe is None:
            probe = asyncio.ensure_future(self.clients[index].health(self.health_timeout_s))
            self._probes[index] = probe
            probe.add_done_callback(lambda _: self._probes.pop(index, None))
        return await asyncio.shield(probe)

    def _too_few(self, alive: int) -> str:
        lost = ", ".join(self.clients[i].base_url for i in sorted(self.down))
        return (
            f"{alive} engine(s) answer, fewer than engine.min_alive={self.min_alive} (lost: {lost}); the run "
            "stops. resume=auto continues from the last checkpoint with fresh engines"
        )

    # ------------------------------------------------------------------------------ at a weight sync
    async def members_for_sync(self) -> list[int] | None:
        """The engines the weight-update group must hold for this sync (the live ones, and the lost ones
        that answer /health_generate again), or None when that is the group as it is. The live ones are
        not probed: one that died unnoticed fails the push, and `recheck` finds it then."""
        back = sorted(self.down)
        self.follow_moves(back)
        answers = await asyncio.gather(*(self.clients[i].health(RETURN_PROBE_S) for i in back))
        wanted = sorted(set(self.live_indices()) | {i for i, ok in zip(back, answers, strict=True) if ok})
        if len(wanted) < self.min_alive:
            raise EnginesLost(self._too_few(len(wanted)))
        # a lost engine that is back rejoins even when no sync went without it: its process is a new one
        rejoining = self.down & set(wanted)
        return None if wanted == self.members and not rejoining else wanted

    async def recheck(self) -> list[int]:
        """After a failed push or check: the group's members that no longer answer within
        engine.health_timeout_s count as lost (returned)."""
        members = list(self.members)
        answers = await asyncio.gather(*(self.clients[i].health(self.health_timeout_s) for i in members))
        lost = [index for index, ok in zip(members, answers, strict=True) if not ok]
        for index in lost:
            log.warning("engine %s does not answer /health_generate: lost", self.clients[index].base_url)
        self.down |= set(lost)
        return lost

    async def replace_spent(
        self, log_dir: Path | str, step: int, reason: str, startup_timeout_s: float
    ) -> list[int] | None:
        """After a push that left the group's engines spent (post-processing not repeatable): ask their
        supervisors to restart every member (`dsv4rl.faults.restart_requests`: a spent engine answers no
        /health_generate, so it cannot be told from one that died in the push, which its supervisor is
        restarting already and says so), wait for the answers and for the engines to answer
        /health_generate again. Returns the engines the new group holds, or None when a restart was
        refused or an engine did not come back within `startup_timeout_s` (the push's failure stands)."""
        spent = list(self.members)
        for index in spent:
            request_restart(log_dir, self.names[index], step, reason)
        self.down |= set(spent)
        log.warning("asked for engines %s to be restarted: %s", [self.names[i] for i in spent], reason)
        deadline = time.monotonic() + ANSWER_WAIT_S
        waiting = list(spent)
        while waiting:
            answers = {index: read_answer(log_dir, self.names[index]) for index in waiting}
            refused = [(i, a) for i, a in answers.items() if a is not None and not a.get("restarted")]
            if refused:
                index, answer = refused[0]
                log.error("%s is not restarted: %s", self.names[index], answer.get("why", "no reason given"))
                return None
            waiting = [index for index, answer in answers.items() if answer is None]
            if waiting and time.monotonic() > deadline:
                log.error(
                    "no supervisor answered the request to restart %s within %g s (every node must share "
                    "the run dir)", [self.names[i] for i in waiting], ANSWER_WAIT_S,
                )  # fmt: skip
                return None
            heartbeat.progress()  # waiting on the supervisors is this sync's progress
            await asyncio.sleep(0.2)
        deadline = time.monotonic() + startup_timeout_s
        loading = list(spent)
        while loading:
            self.follow_moves(loading)
            back = await asyncio.gather(*(self.clients[i].health(RETURN_PROBE_S) for i in loading))
            loading = [index for index, ok in zip(loading, back, strict=True) if not ok]
            if loading and time.monotonic() > deadline:
                names = [self.names[i] for i in loading]
                log.error("%s did not answer within engine.startup_timeout_s=%g s", names, startup_timeout_s)
                return None
            heartbeat.progress()
            await asyncio.sleep(0.5 if loading else 0)
        return await self.members_for_sync()

    def follow_moves(self, indices: Sequence[int]) -> None:
        """The clients of lost engines `indices` that their supervisor restarted on another port (their own
        was taken) follow them there."""
        if self.log_dir is None:
            return
        for index in indices:
            client, port = self.clients[index], moved_port(self.log_dir, self.names[index])
            if port is None or client.base_url == url_with_port(client.base_url, port):
                continue
            was = client.base_url
            client.move_to(url_with_port(was, port))
            log.warning(
                "%s was restarted on port %d (another process holds its port): %s -> %s",
                self.names[index], port, was, client.base_url,
            )  # fmt: skip

    def live_indices(self) -> list[int]:
        return [index for index in range(len(self.clients)) if index not in self.down]

    def regrouped(self, members: Sequence[int]) -> list[int]:
        """The group now holds `members`; returns the engines that rejoined (they take requests now)."""
        rejoined = sorted(self.down & set(members))
        self.down -= set(members)
        self.down |= set(range(len(self.clients))) - set(members)
        self.members = list(members)
        self.restarts += len(rejoined)
        return rejoined  # the loop says so on the console
