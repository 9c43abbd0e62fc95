"""Engine restarts in the supervisor: the policy (`EngineRestarts`) and a supervisor whose fake engine is
killed while the fake trainer runs: restarted with its command and ports, its old process group gone; a
restart loop and an exhausted budget stop the run as before."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
from rich.console import Console

from dsv4rl.config.choices import ProcessRole
from dsv4rl.faults import engine_ports, restart_requests
from dsv4rl.launcher import engine_restarts
from dsv4rl.launcher.engine_restarts import EngineRestarts
from dsv4rl.launcher.plan import ProcessSpec, port_is_free
from dsv4rl.launcher.supervisor import Supervisor
from free_ports import free_port

# A fake engine (`--host H --port P RUN_DIR NAME`): /health_generate on its port; writes "<pid> <grandchild
# pid> <port>" to its pid file (appended per start); fails at start while <run_dir>/broken exists. While
# <run_dir>/orphan-<name> exists at its start, it leaves an orphan in a session of its own that holds its
# listening socket after it dies (pid in <run_dir>/orphan.pid), as a worker that outlived its engine would.
ENGINE = r"""
import http.server, os, subprocess, sys
args = sys.argv[1:]
host, port, (run_dir, name) = args[args.index("--host") + 1], int(args[args.index("--port") + 1]), args[-2:]
if os.path.exists(os.path.join(run_dir, "broken")):
    print("engine: cannot load the weights (fake)", flush=True)
    sys.exit(2)
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
with open(os.path.join(run_dir, name + ".pids"), "a") as f:
    f.write(f"{os.getpid()} {grandchild.pid} {port}\n")
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer.allow_reuse_address = True
server = http.server.ThreadingHTTPServer((host, port), Health)
if os.path.exists(os.path.join(run_dir, "orphan-" + name)):
    os.remove(os.path.join(run_dir, "orphan-" + name))
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              pass_fds=[server.fileno()], start_new_session=True)
    with open(os.path.join(run_dir, "orphan.pid"), "w") as f:
        f.write(str(orphan.pid))
server.serve_forever()
"""
# A fake trainer: runs until <run_dir>/go appears.
TRAINER = r"""
import os, sys, time
while not os.path.exists(os.path.join(sys.argv[1], "go")):
    time.sleep(0.05)
"""


def engine_spec(run_dir: Path, name: str) -> ProcessSpec:
    port = free_port()
    return ProcessSpec(
        name=name,
        argv=[sys.executable, "-c", ENGINE, "--host", "127.0.0.1", "--port", str(port), str(run_dir), name],
        env=dict(os.environ),
        log_path=run_dir / "logs" / f"{name}.log",
        role=ProcessRole.engine,
        health_url=f"http://127.0.0.1:{port}/health_generate",
    )


def trainer_spec(run_dir: Path) -> ProcessSpec:
    return ProcessSpec(
        name="trainer",
        argv=[sys.executable, "-c", TRAINER, str(run_dir)],
        env=dict(os.environ),
        log_path=run_dir / "logs" / "trainer.log",
        role=ProcessRole.trainer,
    )


def starts(run_dir: Path, name: str) -> list[tuple[int, int]]:
    """(pid, grandchild pid) of each start of engine `name`."""
    return [start[:2] for start in ports_and_starts(run_dir, name)]


def ports_and_starts(run_dir: Path, name: str) -> list[tuple[int, int, int]]:
    path = run_dir / f"{name}.pids"
    lines = path.read_text().splitlines() if path.exists() else []
    return [tuple(map(int, line.split())) for line in lines]


def wait_until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def supervise(
    tmp_path: Path, specs: list[ProcessSpec], act, max_restarts: int, **options
) -> tuple[int, str, Supervisor]:
    """Run `specs` under a supervisor (restarts on `max_restarts`) while `act(out)` runs on a thread
    beside it (`out`: the console so far); the fake trainer is told to finish when `act` returns."""
    out = io.StringIO()
    console = Console(file=out, width=250, force_terminal=False, color_system=None)
    engines = sum(spec.role == ProcessRole.engine for spec in specs)
    sup = Supervisor(specs, tmp_path, console=console, grace_s=3.0, poll_s=0.05, startup_timeout_s=20.0,
                     max_restarts=max_restarts, engines=engines, min_alive=1, **options)  # fmt: skip

    def run_act() -> None:
        try:
            act(out)
        finally:
            (tmp_path / "go").touch()

    actor = threading.Thread(target=run_act)
    actor.start()
    code = sup.run()
    actor.join()
    return code, out.getvalue(), sup


def under_way(out: io.StringIO) -> None:
    """The engines answered: a failure from now on is not a failed start (which is never restarted)."""
    wait_until(lambda: any(m in out.getvalue() for m in ("engines healthy", "the trainer is past its wait")))


def run_with_a_kill(
    tmp_path: Path, engines: int, max_restarts: int, then, broken_restart: bool = False
) -> tuple[int, str, Supervisor]:
    """Engine 1 (or 0 when alone) is SIGKILLed once the run is under way; `then()` runs after, and the
    trainer is told to finish. `broken_restart`: from the kill on, the engine fails at start."""
    specs = [engine_spec(tmp_path, f"engine-{i}") for i in range(engines)] + [trainer_spec(tmp_path)]
    victim = f"engine-{engines - 1}"

    def kill(out: io.StringIO) -> None:
        under_way(out)
        if broken_restart:
            (tmp_path / "broken").touch()
        os.kill(starts(tmp_path, victim)[0][0], signal.SIGKILL)
        then()

    return supervise(tmp_path, specs, kill, max_restarts)


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_the_policy_names_why_an_engine_is_not_restarted() -> None:
    assert EngineRestarts(0, engines=2).refusal("engine-1") == (
        "engine.max_restarts=0: an engine failure stops the run"
    )
    alone = EngineRestarts(3, engines=1, min_alive=1).refusal("engine-0")
    assert alone == "without engine-0, 0 engine(s) of the run's 1 answer, fewer than engine.min_alive=1"
    policy = EngineRestarts(2, engines=4, min_alive=3)
    assert policy.refusal("engine-1") is None
    policy.restarted("engine-1", "http://127.0.0.1:1/health_generate")
    assert "a restart loop" in policy.refusal("engine-1")  # failed again before it ever answered
    assert "without engine-2, 2 engine(s) of the run's 4 answer" in policy.refusal("engine-2")
    policy.starting.clear()  # it answered
    policy.restarted("engine-1", None)
    assert policy.refusal("engine-1") == "engine-1 was restarted 2 time(s) already (engine.max_restarts=2)"


def test_a_killed_engine_is_restarted_with_its_command_and_ports_and_the_run_finishes(tmp_path) -> None:
    def restarted_and_answering() -> None:
        wait_until(lambda: len(starts(tmp_path, "engine-1")) == 2)

    code, out, sup = run_with_a_kill(tmp_path, engines=2, max_restarts=3, then=restarted_and_answering)
    assert code == 0, out
    assert "! engine-1 was killed by SIGKILL (exit code -9): restarting it with its command and ports" in out
    assert "(restart 1 of engine.max_restarts=3)" in out
    assert sup.restarts.counts == {"engine-1": 1}
    log = (tmp_path / "logs" / "engine-1.log").read_text()
    assert log.count("starting engine-1:") == 2  # the same log, appended to
    first, second = starts(tmp_path, "engine-1")
    assert first[0] != second[0]
    assert all(gone(pid) for pid in (*first, *second))  # the killed engine's grandchild did not outlive it


def test_an_engine_whose_port_an_orphan_holds_restarts_on_a_free_port_and_says_where(
    tmp_path, monkeypatch
) -> None:
    """The killed engine's orphan keeps its listening socket: the restart waits for the port a moment,
    then takes a free one; the console and `port-<engine>.json` name the move, the probe follows."""
    monkeypatch.setattr(engine_restarts, "PORT_RELEASE_S", 0.5)
    (tmp_path / "orphan-engine-1").touch()
    try:

        def restarted_elsewhere() -> None:
            wait_until(lambda: len(starts(tmp_path, "engine-1")) == 2)
            port = ports_and_starts(tmp_path, "engine-1")[1][2]
            wait_until(lambda: answers(f"http://127.0.0.1:{port}/health_generate"))

        code, out, sup = run_with_a_kill(tmp_path, engines=2, max_restarts=3, then=restarted_elsewhere)
        (_, _, planned), (_, _, moved) = ports_and_starts(tmp_path, "engine-1")
        assert code == 0, out
        assert moved != planned
        assert (
            "! engine-1 was killed by SIGKILL (exit code -9): restarting it with its command and port "
            f"{moved} (another process holds its port {planned}) (restart 1 of engine.max_restarts=3)"
        ) in out
        assert engine_ports.moved_port(tmp_path / "logs", "engine-1") == moved
        assert engine_ports.moved_port(tmp_path / "logs", "engine-0") is None
        assert [c.spec.health_url for c in sup.table.engines() if c.name == "engine-1"] == [
            f"http://127.0.0.1:{moved}/health_generate"
        ]
    finally:
        orphan = tmp_path / "orphan.pid"
        if orphan.exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(orphan.read_text()), signal.SIGKILL)


def test_a_restart_keeps_its_port_when_it_frees_and_moves_with_its_offsets_when_taken(tmp_path) -> None:
    spec = engine_spec(tmp_path, "engine-0")
    host, port = engine_restarts.listen_address(spec)
    assert (host, port) == ("127.0.0.1", int(spec.health_url.split(":")[-1].split("/")[0]))
    assert engine_restarts.port_for_restart(spec, release_s=0.1) is None
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        started = time.monotonic()
        moved = engine_restarts.port_for_restart(spec, offsets=(3, 5), release_s=0.3)
        assert time.monotonic() - started >= 0.3  # it waited for the port to be let go of first
    assert moved is not None and moved != port
    assert all(port_is_free("127.0.0.1", moved + offset) for offset in (0, 3, 5))
    on_new = engine_restarts.on_port(spec, moved)
    assert on_new.argv[on_new.argv.index("--port") + 1] == str(moved)
    assert on_new.health_url == f"http://127.0.0.1:{moved}/health_generate"
    assert on_new.meta["port"] == str(moved) and spec.argv[spec.argv.index("--port") + 1] == str(port)
    no_port = ProcessSpec("engine-9", ["x"], {}, tmp_path / "x.log", ProcessRole.engine)
    assert engine_restarts.listen_address(no_port) is None
    assert engine_restarts.port_for_restart(no_port) is None


def test_without_restarts_the_kill_stops_the_run_as_before(tmp_path) -> None:
    code, out, sup = run_with_a_kill(tmp_path, engines=2, max_restarts=0, then=lambda: None)
    assert code == 128 + signal.SIGKILL
    assert "engine-1 was killed by SIGKILL" in out and "restarting" not in out
    assert sup.status == "failed"


def test_the_runs_only_engine_is_not_restarted(tmp_path) -> None:
    code, out, _ = run_with_a_kill(tmp_path, engines=1, max_restarts=3, then=lambda: None)
    assert code == 128 + signal.SIGKILL
    assert "✗ not restarted: without engine-0, 0 engine(s) of the run's 1 answer" in out


def test_an_engine_that_fails_again_at_start_is_a_restart_loop_not_retried(tmp_path) -> None:
    code, out, sup = run_with_a_kill(
        tmp_path, engines=2, max_restarts=3, then=lambda: time.sleep(0.5), broken_restart=True
    )
    assert code == 2, out
    assert (
        "engine-1 failed again before it answered /health_generate after its restart: a restart loop" in out
    )
    assert sup.restarts.counts == {"engine-1": 1}


def run_with_restart_requests(tmp_path: Path, engines: int, max_restarts: int) -> tuple[int, str, Supervisor]:
    """The trainer (here: the test) asks for every engine to be restarted, as after a push that left them
    spent, and waits for each answer before it finishes."""
    specs = [engine_spec(tmp_path, f"engine-{i}") for i in range(engines)] + [trainer_spec(tmp_path)]
    logs = tmp_path / "logs"
    names = [f"engine-{i}" for i in range(engines)]

    def ask(out: io.StringIO) -> None:
        wait_until(lambda: all(starts(tmp_path, name) for name in names))
        for name in names:
            restart_requests.request_restart(logs, name, 5, "the push of step 5 failed half way")
        wait_until(lambda: all(restart_requests.read_answer(logs, name) for name in names))
        restarted = [name for name in names if restart_requests.read_answer(logs, name)["restarted"]]
        wait_until(lambda: all(len(starts(tmp_path, name)) == 2 for name in restarted))  # they run

    return supervise(tmp_path, specs, ask, max_restarts)


def test_engines_the_trainer_asks_to_restart_are_restarted_and_the_answers_say_so(tmp_path) -> None:
    """Both engines at once, and the run's only engine: the trainer waits for them, so the engines still
    answering do not count against engine.min_alive."""
    for engines in (2, 1):
        run_dir = tmp_path / f"engines{engines}"
        run_dir.mkdir()
        code, out, sup = run_with_restart_requests(run_dir, engines, max_restarts=3)
        assert code == 0, out
        for i in range(engines):
            assert (
                f"! the trainer asks for engine-{i} to be restarted (the push of step 5 failed half way): "
                f"killing it to restart it" in out
            )
            assert restart_requests.read_answer(run_dir / "logs", f"engine-{i}") == {
                "restarted": True,
                "why": "",
            }
            assert len(starts(run_dir, f"engine-{i}")) == 2
        assert "the trainer waits for it" in out
        assert sup.restarts.counts == {f"engine-{i}": 1 for i in range(engines)}


def test_a_restart_the_budget_refuses_is_answered_with_the_reason(tmp_path) -> None:
    code, out, _ = run_with_restart_requests(tmp_path, engines=2, max_restarts=0)
    assert code == 0, out
    answer = restart_requests.read_answer(tmp_path / "logs", "engine-0")
    assert answer == {"restarted": False, "why": "engine.max_restarts=0: an engine failure stops the run"}
    assert "✗ engine-0 is not restarted as the trainer asked: engine.max_restarts=0" in out
    assert len(starts(tmp_path, "engine-0")) == 1


def test_an_engine_that_died_in_the_push_is_answered_as_restarted(tmp_path) -> None:
    """The trainer cannot tell a spent engine from one that died in the push (neither answers its health
    probe), so it asks for both: the dead one is restarted once and answered so, whichever the supervisor
    saw first, the request or the exit."""
    specs = [engine_spec(tmp_path, f"engine-{i}") for i in range(2)] + [trainer_spec(tmp_path)]
    logs = tmp_path / "logs"

    def died_and_asked(out: io.StringIO) -> None:
        under_way(out)
        restart_requests.request_restart(logs, "engine-1", 5, "the push of step 5 failed")
        os.kill(starts(tmp_path, "engine-1")[0][0], signal.SIGKILL)
        wait_until(lambda: restart_requests.read_answer(logs, "engine-1") is not None)
        wait_until(lambda: len(starts(tmp_path, "engine-1")) == 2)

    code, out, sup = supervise(tmp_path, specs, died_and_asked, max_restarts=3)
    assert code == 0, out
    assert restart_requests.read_answer(logs, "engine-1")["restarted"] is True
    assert sup.restarts.counts == {"engine-1": 1} and len(starts(tmp_path, "engine-1")) == 2
