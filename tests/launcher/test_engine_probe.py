"""Hang detection for engines without heartbeats (SGLang): the probe's rules with a stand-in probe and
clock, then a supervisor whose fake SGLang engine stops answering /health_generate while the fake
trainer's rank 0 is in its rollout: killed and restarted, the run goes on."""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

from test_engine_restarts import supervise, under_way, wait_until

from dsv4rl.config.choices import ProcessRole
from dsv4rl.faults.files import HEARTBEAT, fault_file, write_json_atomic
from dsv4rl.faults.heartbeat import Beat
from dsv4rl.launcher.child_faults import ChildFaults
from dsv4rl.launcher.engine_probe import SilentEngineProbe, answers, requests_open, silent_engines
from dsv4rl.launcher.plan import ProcessSpec
from dsv4rl.launcher.supervisor import Supervisor
from free_ports import free_port

URL = "http://127.0.0.1:1/health_generate"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def settled(probe: SilentEngineProbe) -> SilentEngineProbe:
    """Wait for the probes in flight (the stand-in answers at once)."""
    for target in probe._targets.values():
        if target.probe is not None:
            target.probe.result(timeout=5)
    return probe


def beat(process: str, phase: str) -> Beat:
    return Beat(process, 1, "host", phase, 3, 0.0, 0.0, False)


def test_requests_are_open_while_rank_0_generates_or_scores() -> None:
    assert requests_open([beat("trainer-rank0", "rollout"), beat("trainer-rank1", "wait_batch")])
    assert requests_open([beat("trainer-rank0", "train")])  # algo.async_rollout generates meanwhile
    assert not requests_open([beat("trainer-rank0", "sync")])  # engines loading weights answer no generate
    assert not requests_open([beat("trainer-rank1", "rollout")])  # rank 0 alone talks to the engines
    assert not requests_open([])


def test_only_engines_without_heartbeats_are_probed(tmp_path) -> None:
    def spec(name: str, role: ProcessRole, kind: str | None) -> ProcessSpec:
        meta = {"kind": kind} if kind else {}
        url = URL if role == ProcessRole.engine else None
        return ProcessSpec(name, ["x"], {}, tmp_path / "log", role, health_url=url, meta=meta)

    specs = [
        spec("engine-0", ProcessRole.engine, "sglang"),
        spec("engine-1", ProcessRole.engine, "reference"),
    ]
    assert silent_engines([*specs, spec("trainer", ProcessRole.trainer, None)]) == [("engine-0", URL)]


def test_a_node_that_only_serves_rollouts_reads_the_trainers_phase_from_the_shared_run_dir(tmp_path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    beat = asdict(Beat("trainer-rank0", 7, "node0", "rollout", 3, 0.0, 0.0, False))
    write_json_atomic(fault_file(logs, HEARTBEAT, "trainer-rank0"), beat)  # as the trainer's node writes it
    engine = ProcessSpec(
        "engine-2", ["x"], {}, logs / "engine-2.log", ProcessRole.engine, URL, {"kind": "sglang"}
    )
    beats = ChildFaults([engine]).trainer_beats()
    assert [b.process for b in beats] == ["trainer-rank0"] and requests_open(beats)


def test_two_probes_in_a_row_without_an_answer_make_an_engine_hung_once() -> None:
    answers = {"engine-0": True, "engine-1": False}
    clock = Clock()
    probe = SilentEngineProbe(
        [("engine-0", "engine-0"), ("engine-1", "engine-1")],
        10.0,
        probe=lambda url, _: answers[url],
        clock=clock,
    )
    assert settled(probe).observe(True) == []  # the first probes go out
    clock.now = 5.0
    assert settled(probe).observe(True) == []  # one miss counted; no new probe before health_timeout_s
    clock.now = 10.0
    assert settled(probe).observe(True) == []
    assert settled(probe).observe(True) == ["engine-1"]  # the second miss in a row
    clock.now = 20.0
    assert settled(probe).observe(True) == []  # reported once, then probed afresh
    assert "engine-1 did not answer /health_generate within engine.health_timeout_s=10 s 2 times" in (
        probe.describe("engine-1")
    )
    probe.close()


def test_an_answer_or_a_weight_sync_between_misses_starts_the_count_again() -> None:
    replies = iter([False, True, False, False, False])
    clock = Clock()
    probe = SilentEngineProbe([("engine-0", URL)], 1.0, probe=lambda *_: next(replies), clock=clock)

    def tick(open_requests: bool = True) -> list[str]:
        clock.now += 1.0
        found = settled(probe).observe(open_requests)
        return found + settled(probe).observe(open_requests)

    assert tick() == []  # miss
    assert tick() == []  # answer: the count starts again
    assert tick() == []  # miss
    assert tick(open_requests=False) == []  # a weight sync: the count starts again
    assert tick() == []  # miss
    assert tick() == ["engine-0"]  # miss, miss
    probe.close()


def test_a_probe_that_outlives_its_stretch_of_requests_does_not_count() -> None:
    release = threading.Event()
    clock = Clock()
    probe = SilentEngineProbe(
        [("engine-0", URL)], 1.0, misses=1, probe=lambda *_: release.wait(5) and False, clock=clock
    )
    assert probe.observe(True) == []  # sent while the trainer generates...
    assert probe.observe(False) == []  # ...the trainer pushes weights...
    assert probe.observe(True) == []  # ...and generates again
    release.set()
    assert settled(probe).observe(True) == []  # the old probe's miss is not counted
    clock.now = 1.0
    assert settled(probe).observe(True) == []  # a new probe, sent in this stretch
    assert settled(probe).observe(True) == ["engine-0"]
    probe.close()


def test_a_restarted_engine_still_loading_is_not_probed() -> None:
    calls = []
    probe = SilentEngineProbe([("engine-0", URL)], 1.0, probe=lambda *args: calls.append(args) or False)
    assert settled(probe).observe(True, skip={"engine-0": URL}) == []
    assert calls == []
    probe.close()


def test_an_engine_restarted_on_another_port_is_probed_there_with_a_fresh_count() -> None:
    probed = []
    clock = Clock()
    probe = SilentEngineProbe([("engine-0", URL)], 1.0, probe=lambda url, _: probed.append(url), clock=clock)
    assert settled(probe).observe(True) == []  # a probe at the old address goes out
    assert settled(probe).observe(True) == [] and probe._targets["engine-0"].misses == 1
    moved = "http://127.0.0.1:2/health_generate"
    probe.follow("engine-0", moved)
    probe.follow("engine-7", moved)  # not this node's: nothing to follow
    clock.now = 1.0
    assert settled(probe).observe(True) == []  # its first probe at the new address goes out
    settled(probe)
    assert probed == [URL, moved] and list(probe._targets) == ["engine-0"]
    assert probe._targets["engine-0"].misses == 0  # the old address's miss is forgotten
    probe.close()


# A fake SGLang engine: 200 on /health_generate, except the process whose pid is in <run_dir>/<name>.hang,
# which never answers (a stuck scheduler); writes its pid to <run_dir>/<name>.pids per start.
ENGINE = r"""
import http.server, os, sys, time
port, run_dir, name = int(sys.argv[1]), sys.argv[2], sys.argv[3]
with open(os.path.join(run_dir, name + ".pids"), "a") as f:
    f.write(f"{os.getpid()}\n")
hang_file = os.path.join(run_dir, name + ".hang")
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if os.path.exists(hang_file) and open(hang_file).read() == str(os.getpid()):
            time.sleep(120)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer.allow_reuse_address = True
http.server.ThreadingHTTPServer(("127.0.0.1", port), Health).serve_forever()
"""
# A fake trainer: rank 0 in its rollout (requests open) until <run_dir>/go appears.
TRAINER = r"""
import os, sys, time
from dsv4rl.faults import heartbeat
from dsv4rl.faults.child import child_process
with child_process("trainer", rank=0):
    heartbeat.enter("rollout", 1)
    while not os.path.exists(os.path.join(sys.argv[1], "go")):
        time.sleep(0.05)
"""


def pids(run_dir: Path, name: str) -> list[int]:
    path = run_dir / f"{name}.pids"
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def run_with_a_stuck_engine(tmp_path: Path, max_restarts: int, then) -> tuple[int, str, Supervisor]:
    specs = []
    for i in range(2):
        port = free_port()
        specs.append(
            ProcessSpec(
                name=f"engine-{i}",
                argv=[sys.executable, "-c", ENGINE, str(port), str(tmp_path), f"engine-{i}"],
                env=dict(os.environ),
                log_path=tmp_path / "logs" / f"engine-{i}.log",
                role=ProcessRole.engine,
                health_url=f"http://127.0.0.1:{port}/health_generate",
                meta={"kind": "sglang"},
            )
        )
    specs.append(
        ProcessSpec(
            "trainer",
            [sys.executable, "-c", TRAINER, str(tmp_path)],
            dict(os.environ),
            tmp_path / "logs" / "trainer.log",
            ProcessRole.trainer,
        )  # fmt: skip
    )

    def stick(out) -> None:
        under_way(out)  # past the supervisor's startup wait, whose own probe would otherwise meet the hang
        assert answers(specs[1].health_url, 1.0)
        (tmp_path / "engine-1.hang").write_text(str(pids(tmp_path, "engine-1")[0]))
        then(out)

    return supervise(tmp_path, specs, stick, max_restarts, health_timeout_s=0.5)


def test_an_engine_that_stops_answering_while_requests_are_open_is_restarted(tmp_path) -> None:
    code, out, sup = run_with_a_stuck_engine(
        tmp_path,
        3,
        lambda out: wait_until(lambda: "rejoins at the trainer's next weight sync" in out.getvalue()),
    )
    assert code == 0, out
    assert (
        "! hang: engine-1 did not answer /health_generate within engine.health_timeout_s=0.5 s 2 times in a "
        "row while the trainer had requests open: killing engine-1 to restart it" in out
    )
    assert "engine-1 was killed by SIGKILL" in out and "(restart 1 of engine.max_restarts=3)" in out
    assert len(pids(tmp_path, "engine-1")) == 2 and len(pids(tmp_path, "engine-0")) == 1
    assert sup.restarts.counts == {"engine-1": 1}


def test_without_restarts_nothing_is_probed(tmp_path) -> None:
    code, out, sup = run_with_a_stuck_engine(tmp_path, 0, lambda out: time.sleep(2.0))  # 4 probe periods
    assert code == 0, out
    assert "hang" not in out and sup.silent_probe.targets == []
    assert len(pids(tmp_path, "engine-1")) == 1
