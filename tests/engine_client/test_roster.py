"""EngineRoster: which engines take requests, who rejoins the weight-update group at a sync, and when too
few answer for the run to go on. Dead engines are clients whose connection is refused."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from dsv4rl.config.compose import compose
from dsv4rl.engine_client import roster as roster_module
from dsv4rl.engine_client.client import EngineClient, EngineError
from dsv4rl.engine_client.roster import EngineRoster, EnginesLost, restart_budget
from dsv4rl.faults import engine_ports, restart_requests


def refused(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


class Engine:
    """An engine whose process can die and come back: a client on the SGLang double, or refused."""

    def __init__(self, app, index: int) -> None:
        self.alive = True
        self.port = 30000  # where it listens: a restart may move it
        self.app = app
        inner = httpx.ASGITransport(app=app)

        async def handle(request: httpx.Request) -> httpx.Response:
            if not self.alive or request.url.port != self.port:
                refused(request)
            return await inner.handle_async_request(request)

        self.client = EngineClient(
            f"http://engine-{index}:30000", transport=httpx.MockTransport(handle), retries=0, backoff_s=0.01
        )


@pytest.fixture
def engines(new_app) -> list[Engine]:
    return [Engine(new_app(), index) for index in range(3)]


def lost_error(engine: Engine) -> EngineError:
    return EngineError(engine.client.base_url, "/generate", "cannot connect")


def test_a_dead_engine_is_lost_and_its_call_goes_to_the_least_busy_live_one(engines) -> None:
    roster = EngineRoster([e.client for e in engines], min_alive=1, health_timeout_s=1.0)
    engines[1].alive = False
    instead = asyncio.run(roster.reroute(engines[1].client, lost_error(engines[1])))
    assert instead in (engines[0].client, engines[2].client)
    assert roster.down == {1} and roster.resent == 1
    assert roster.live() == [engines[0].client, engines[2].client]
    assert roster.metrics() == {"engine/restarts": 0, "engine/alive": 2, "rollout/resent": 1}


def test_calls_that_fail_together_share_one_health_probe_and_one_warning(engines, caplog) -> None:
    """A dead engine fails all its calls at once (every trajectory's turn): one probe, one warning,
    and each call is sent to a live engine."""
    roster = EngineRoster([e.client for e in engines], min_alive=1, health_timeout_s=1.0)
    engines[1].alive = False
    probes = []
    health = engines[1].client.health

    async def counted(timeout_s: float) -> bool:
        probes.append(timeout_s)
        await asyncio.sleep(0.05)  # the others fail meanwhile
        return await health(timeout_s)

    engines[1].client.health = counted

    async def five_calls() -> list:
        return await asyncio.gather(
            *(roster.reroute(engines[1].client, lost_error(engines[1])) for _ in range(5))
        )

    with caplog.at_level("WARNING", logger="dsv4rl.rollout"):
        instead = asyncio.run(five_calls())
    assert len(probes) == 1 and roster.resent == 5
    assert all(client in (engines[0].client, engines[2].client) for client in instead)
    assert sum("is lost" in record.getMessage() for record in caplog.records) == 1


def test_a_failure_that_is_not_the_engines_is_not_rerouted(engines) -> None:
    roster = EngineRoster([e.client for e in engines], min_alive=1, health_timeout_s=1.0)
    assert asyncio.run(roster.reroute(engines[0].client, lost_error(engines[0]))) is None  # it answers
    assert asyncio.run(roster.reroute(engines[0].client, ValueError("bad output"))) is None
    assert roster.down == set() and roster.resent == 0


def test_fewer_live_engines_than_min_alive_stops_the_run(engines) -> None:
    roster = EngineRoster([e.client for e in engines], min_alive=2, health_timeout_s=1.0)
    engines[0].alive = engines[1].alive = False
    asyncio.run(roster.reroute(engines[0].client, lost_error(engines[0])))
    with pytest.raises(EnginesLost, match=r"1 engine\(s\) answer, fewer than engine.min_alive=2 \(lost: "):
        asyncio.run(roster.reroute(engines[1].client, lost_error(engines[1])))


def test_the_group_follows_the_engines_and_a_returning_engine_rejoins_at_a_sync(engines) -> None:
    roster = EngineRoster([e.client for e in engines], min_alive=1, health_timeout_s=1.0)
    assert asyncio.run(roster.members_for_sync()) is None  # nothing changed: the group stays
    engines[2].alive = False
    asyncio.run(roster.reroute(engines[2].client, lost_error(engines[2])))
    assert asyncio.run(roster.members_for_sync()) == [0, 1]  # the sync goes without engine 2
    assert roster.regrouped([0, 1]) == []
    assert asyncio.run(roster.members_for_sync()) is None
    engines[2].alive = True  # restarted by its supervisor: a new process, holding the model it loaded
    assert asyncio.run(roster.members_for_sync()) == [0, 1, 2]
    assert roster.regrouped([0, 1, 2]) == [2]
    assert roster.down == set() and roster.restarts == 1 and len(roster.live()) == 3


def test_an_engine_back_before_any_sync_went_without_it_still_rejoins(engines) -> None:
    """Its process is new: it holds the model it loaded and is in no group, so the group is rebuilt."""
    roster = EngineRoster([e.client for e in engines], min_alive=1, health_timeout_s=1.0)
    engines[1].alive = False
    asyncio.run(roster.reroute(engines[1].client, lost_error(engines[1])))
    engines[1].alive = True
    assert asyncio.run(roster.members_for_sync()) == [0, 1, 2]
    assert roster.regrouped([0, 1, 2]) == [1]


def test_a_lost_engine_restarted_on_another_port_is_followed_there_and_rejoins(
    engines, tmp_path, caplog
) -> None:
    """Its supervisor found its port taken and started it on another (`port-engine-1.json`): the roster
    reads the move before it asks the engine, and every later request goes to the new address."""
    roster = EngineRoster([e.client for e in engines], min_alive=1, health_timeout_s=1.0, log_dir=tmp_path)
    engines[1].alive = False
    asyncio.run(roster.reroute(engines[1].client, lost_error(engines[1])))
    engines[1].alive, engines[1].port = True, 30007
    assert asyncio.run(roster.members_for_sync()) == [0, 2]  # no move recorded: its old address is dead
    engine_ports.record_move(tmp_path, "engine-1", 30007, 30000)
    with caplog.at_level("WARNING", logger="dsv4rl.rollout"):
        assert asyncio.run(roster.members_for_sync()) == [0, 1, 2]
    assert engines[1].client.base_url == "http://engine-1:30007"
    assert "engine-1 was restarted on port 30007 (another process holds its port): " in caplog.text
    assert "http://engine-1:30000 -> http://engine-1:30007" in caplog.text
    assert roster.regrouped([0, 1, 2]) == [1]
    assert asyncio.run(engines[1].client.health(1.0))  # a request after the move reaches it
    caplog.clear()
    roster.follow_moves([1])  # followed once: nothing new to say
    assert caplog.text == ""


def test_after_a_failed_push_the_members_that_do_not_answer_are_lost(engines) -> None:
    roster = EngineRoster([e.client for e in engines], min_alive=1, health_timeout_s=1.0)
    engines[0].alive = False
    assert asyncio.run(roster.recheck()) == [0]
    assert asyncio.run(roster.members_for_sync()) == [1, 2]


def test_colocated_engines_are_never_restarted() -> None:
    assert restart_budget(compose("tiny_arith")) == 3
    assert restart_budget(compose("tiny_arith", ["engine.max_restarts=0"])) == 0
    assert restart_budget(compose("tiny_arith", ["parallel.colocate=true"])) == 0


class FakeSupervisor(threading.Thread):
    """Answers the trainer's restart requests as a node supervisor does: kills the engine, answers, and
    brings it back a moment later (or refuses with `refuse`)."""

    def __init__(self, log_dir, engines: list[Engine], refuse: str | None = None) -> None:
        super().__init__(daemon=True)
        self.log_dir, self.engines, self.refuse = log_dir, engines, refuse
        self.stop = threading.Event()
        self.restarted: list[str] = []

    def run(self) -> None:
        while not self.stop.is_set():
            for index, engine in enumerate(self.engines):
                name = f"engine-{index}"
                if restart_requests.pending_request(self.log_dir, name) is None:
                    continue
                if self.refuse:
                    restart_requests.answer_request(self.log_dir, name, False, self.refuse)
                    continue
                engine.alive = False
                restart_requests.answer_request(self.log_dir, name, True)
                self.restarted.append(name)
                threading.Timer(0.3, lambda engine=engine: setattr(engine, "alive", True)).start()
            time.sleep(0.02)


def test_spent_engines_are_restarted_on_request_and_form_the_new_group(engines, tmp_path) -> None:
    """After a push that spent the group (engine 2 died in it): every member is asked for (a spent engine
    answers no health probe either), restarted and waited for; the group is rebuilt with all of them."""
    roster = EngineRoster([e.client for e in engines], min_alive=1, health_timeout_s=1.0)
    engines[2].alive = False
    supervisor = FakeSupervisor(tmp_path, engines)
    supervisor.start()
    try:
        members = asyncio.run(roster.replace_spent(tmp_path, 5, "the push of step 5 failed", 10.0))
    finally:
        supervisor.stop.set()
    assert members == [0, 1, 2] and supervisor.restarted == ["engine-0", "engine-1", "engine-2"]
    assert roster.down == {0, 1, 2}  # until the regroup: `regrouped` lets them take requests again
    assert roster.regrouped(members) == [0, 1, 2] and roster.live_indices() == [0, 1, 2]


def test_a_refused_restart_or_no_answer_leaves_the_failure_standing(engines, tmp_path, monkeypatch) -> None:
    roster = EngineRoster([e.client for e in engines], min_alive=1, health_timeout_s=1.0)
    supervisor = FakeSupervisor(tmp_path, engines, refuse="engine.max_restarts=0")
    supervisor.start()
    try:
        assert asyncio.run(roster.replace_spent(tmp_path, 5, "why", 10.0)) is None
    finally:
        supervisor.stop.set()
    monkeypatch.setattr(roster_module, "ANSWER_WAIT_S", 0.2)  # no supervisor reads the run dir
    silent = EngineRoster([e.client for e in engines], min_alive=1, health_timeout_s=1.0)
    assert asyncio.run(silent.replace_spent(tmp_path / "elsewhere", 5, "why", 10.0)) is None
