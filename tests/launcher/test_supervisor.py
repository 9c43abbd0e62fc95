"""The supervisor with fake children: a fake engine (http.server answering /health_generate) and a fake
trainer (writes metrics.jsonl), each with a grandchild, all pids written to files so the test can check
that nothing outlives a run."""

from __future__ import annotations

import contextlib
import http.server
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from rich.console import Console

from dsv4rl.config.choices import ProcessRole
from dsv4rl.config.schema import Config
from dsv4rl.faults.failed_push import FAILED_PUSH_EXIT
from dsv4rl.launcher.marker import DoneMarker, read_status, write_marker
from dsv4rl.launcher.plan import PortInUse, ProcessSpec
from dsv4rl.launcher.run import run_training
from dsv4rl.launcher.supervisor import Supervisor
from free_ports import free_port, free_ports

PIDS = r"""
import os, subprocess, sys
def spawn_grandchild(pid_file, new_session=False):
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    gc = subprocess.Popen(sleeper, start_new_session=new_session)
    with open(pid_file + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {gc.pid}")
    os.rename(pid_file + ".tmp", pid_file)
"""

ENGINE = (
    PIDS
    + r"""
import http.server, time
port, pid_file, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
spawn_grandchild(pid_file)
if mode == "crash":
    print("engine: CUDA out of memory (fake)", flush=True)
    sys.exit(2)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health_generate" and mode != "sick" else 503)
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
print(f"engine: serving on {port}", flush=True)
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""
)

TRAINER = (
    PIDS
    + r"""
import json, time
metrics, pid_file, steps, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
spawn_grandchild(pid_file, new_session=True)  # like torchrun's workers: a session of their own
for step in range(1, steps + 1):
    rec = {"step": step, "reward_mean": step / 10, "reward_std": 0.1, "response_len_mean": 5.0,
           "logprob_abs_diff": 0.0, "kl": 0.0, "entropy": 1.0, "grad_norm": 0.5, "time_rollout_s": 0.4,
           "time_reward_s": 0.1, "time_train_s": 0.3, "time_sync_s": 0.1, "time_step_s": 1.0,
           "sync_bytes": 2048}
    with open(metrics, "a") as f:
        f.write(json.dumps(rec) + "\n")
    print(f"trainer: step {step}", flush=True)
    time.sleep(0.02)
if mode == "fail":
    print("Traceback (most recent call last):\nRuntimeError: boom", flush=True)
    sys.exit(3)
if mode == "failed_push":  # as trainer rank 0 after a push that spent the engines
    from dsv4rl.faults.failed_push import write_failed_push
    write_failed_push(os.path.dirname(metrics), steps + 1, None, "bucket 0: HTTP 400")
    print("Traceback (most recent call last):\nWeightSyncError: never push to them again", flush=True)
    sys.exit(1)
if mode == "hang":
    time.sleep(120)
"""
)


def engine_spec(run_dir: Path, port: int, mode: str = "ok", name: str = "engine-0") -> ProcessSpec:
    pid_file = str(run_dir / f"{name}.pids")
    return ProcessSpec(
        name=name,
        argv=[sys.executable, "-c", ENGINE, str(port), pid_file, mode],
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        log_path=run_dir / "logs" / f"{name}.log",
        role=ProcessRole.engine,
        health_url=f"http://127.0.0.1:{port}/health_generate",
    )


def trainer_spec(run_dir: Path, steps: int = 3, mode: str = "ok") -> ProcessSpec:
    pid_file = str(run_dir / "trainer.pids")
    return ProcessSpec(
        name="trainer",
        argv=[sys.executable, "-c", TRAINER, str(run_dir / "metrics.jsonl"), pid_file, str(steps), mode],
        env=dict(os.environ),
        log_path=run_dir / "logs" / "trainer.log",
        role=ProcessRole.trainer,
    )


def capture() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, width=160, force_terminal=False, color_system=None), out


def written_pids(run_dir: Path) -> list[int]:
    pids = []
    for f in run_dir.glob("*.pids"):
        pids += [int(p) for p in f.read_text().split()]
    return pids


def assert_all_gone(pids: list[int]) -> None:
    assert pids
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def wait_for(path: Path, timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.02)
    return path.read_text()


def supervisor(specs, run_dir, console, **kwargs) -> Supervisor:
    kwargs.setdefault("grace_s", 3.0)
    kwargs.setdefault("poll_s", 0.05)
    kwargs.setdefault("startup_timeout_s", 10.0)
    return Supervisor(specs, run_dir, total_steps=3, console=console, **kwargs)


def test_success_returns_0_and_stops_the_engine(tmp_path):
    console, out = capture()
    specs = [engine_spec(tmp_path, free_port()), trainer_spec(tmp_path, steps=3)]
    sup = supervisor(specs, tmp_path, console)
    assert sup.run() == 0
    text = out.getvalue()
    assert "step 3/3 | reward 0.3" in text and "rollout 40%" in text  # one line per step without a TTY
    assert "finished" in text and "final reward" in text and str(tmp_path) in text
    assert sup.progress.step == 3 and sup.progress.time["rollout"] == pytest.approx(1.2)
    engine = sup.children[0].proc
    assert engine.returncode == -signal.SIGTERM  # stopped by the supervisor, not crashed
    assert "engine: serving on" in (tmp_path / "logs" / "engine-0.log").read_text()
    assert_all_gone(written_pids(tmp_path))


def test_log_every_prints_every_kth_step_and_the_last(tmp_path):
    """train.log_every=2 over 3 steps: lines for steps 2 and 3 (the last); every step still counts."""
    console, out = capture()
    specs = [engine_spec(tmp_path, free_port()), trainer_spec(tmp_path, steps=3)]
    sup = supervisor(specs, tmp_path, console, log_every=2)
    assert sup.run() == 0
    text = out.getvalue()
    assert "step 1/3" not in text and "step 2/3 |" in text and "step 3/3 |" in text
    assert sup.progress.step == 3


def test_engine_killed_mid_run_fails_the_run_without_orphans(tmp_path):
    console, out = capture()
    specs = [engine_spec(tmp_path, free_port()), trainer_spec(tmp_path, steps=1, mode="hang")]
    sup = supervisor(specs, tmp_path, console)

    def kill_engine():
        wait_for(tmp_path / "trainer.pids")
        engine_pid = int(wait_for(tmp_path / "engine-0.pids").split()[0])
        os.kill(engine_pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_engine)
    killer.start()
    code = sup.run()
    killer.join()
    text = out.getvalue()
    assert code == 128 + signal.SIGKILL
    assert "engine-0 was killed by SIGKILL" in text
    assert "engine: serving on" in text  # the failing child's last log lines
    assert "failed" in text
    assert_all_gone(written_pids(tmp_path))


def test_trainer_failure_shows_its_traceback(tmp_path):
    console, out = capture()
    specs = [engine_spec(tmp_path, free_port()), trainer_spec(tmp_path, steps=2, mode="fail")]
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "trainer.log").write_text("line from an earlier run\n")
    sup = supervisor(specs, tmp_path, console)
    assert sup.run() == 3
    text = out.getvalue()
    assert "earlier run" not in text  # logs are appended; the tail shows this run only
    assert "trainer exited with code 3" in text and "RuntimeError: boom" in text
    assert re.search(r"steps +2 / 3", text)
    assert_all_gone(written_pids(tmp_path))


def test_trainer_killed_leaves_no_orphaned_worker(tmp_path):
    console, out = capture()
    specs = [engine_spec(tmp_path, free_port()), trainer_spec(tmp_path, steps=1, mode="hang")]
    sup = supervisor(specs, tmp_path, console)

    def kill_trainer():  # like torchrun dying: its worker (own session) stays behind
        trainer, worker = map(int, wait_for(tmp_path / "trainer.pids").split())
        deadline = time.monotonic() + 10
        while worker not in sup.tracker.seen and time.monotonic() < deadline:  # the supervisor saw it
            time.sleep(0.01)
        os.kill(trainer, signal.SIGKILL)

    killer = threading.Thread(target=kill_trainer)
    killer.start()
    assert sup.run() == 128 + signal.SIGKILL
    killer.join()
    assert "trainer was killed by SIGKILL" in out.getvalue()
    assert_all_gone(written_pids(tmp_path))


def test_engine_crash_at_startup_stops_the_trainer_that_started_with_it(tmp_path):
    """The trainer starts with the engines (it waits for them itself); an engine dying while they load
    stops it, and the engine is named, not the trainer it took down."""
    console, out = capture()
    specs = [engine_spec(tmp_path, free_port(), mode="crash"), trainer_spec(tmp_path, mode="hang")]
    assert supervisor(specs, tmp_path, console).run() == 2
    text = out.getvalue()
    assert text.index("started trainer") < text.index("waiting for 1 engine(s)")
    assert "engine-0 exited with code 2" in text and "CUDA out of memory (fake)" in text
    assert "trainer exited" not in text
    assert_all_gone(written_pids(tmp_path))


def test_trainer_failing_while_the_engines_load_is_reported_at_once(tmp_path):
    console, out = capture()
    specs = [engine_spec(tmp_path, free_port(), mode="sick"), trainer_spec(tmp_path, steps=0, mode="fail")]
    start = time.monotonic()
    assert supervisor(specs, tmp_path, console, startup_timeout_s=60.0).run() == 3
    assert time.monotonic() - start < 20  # not the engines' 60 s startup timeout
    text = out.getvalue()
    assert "trainer exited with code 3" in text and "RuntimeError: boom" in text
    assert "engine-0 is not healthy" not in text
    assert_all_gone(written_pids(tmp_path))


def test_unhealthy_engine_times_out(tmp_path):
    console, out = capture()
    specs = [engine_spec(tmp_path, free_port(), mode="sick"), trainer_spec(tmp_path)]
    assert supervisor(specs, tmp_path, console, startup_timeout_s=1.0).run() == 1
    text = out.getvalue()
    assert "engine-0 is not healthy" in text and "not healthy after waiting 1." in text
    assert "last probe: HTTP 503" in text
    assert_all_gone(written_pids(tmp_path))


def test_sigterm_to_the_supervisor_stops_everything(tmp_path):
    console, out = capture()
    specs = [engine_spec(tmp_path, free_port()), trainer_spec(tmp_path, steps=1, mode="hang")]
    sup = supervisor(specs, tmp_path, console)

    def interrupt():
        wait_for(tmp_path / "trainer.pids")
        os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    threading.Thread(target=interrupt).start()
    assert sup.run() == 130
    assert signal.getsignal(signal.SIGTERM) is before
    assert "SIGTERM received" in out.getvalue() and "interrupted" in out.getvalue()
    assert_all_gone(written_pids(tmp_path))


def _cfg(run_dir: Path) -> Config:
    cfg = Config()
    cfg.run.dir = str(run_dir)
    cfg.train.steps = 2
    cfg.engine.port, cfg.cluster.master_port, cfg.cluster.weight_sync_port = free_ports(3)
    return cfg


def test_busy_port_stops_run_training_before_anything_starts(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path / "run")

    def no_popen(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr(subprocess, "Popen", no_popen)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", cfg.engine.port))
        holder.listen()
        with pytest.raises(PortInUse, match=rf"port {cfg.engine.port} .*engine.port="):
            run_training(cfg, console=capture()[0])
    assert not (tmp_path / "run").exists()


def test_run_training_writes_config_and_runs_the_plan(tmp_path):
    cfg = _cfg(tmp_path / "run")
    cfg.model.path = str(tmp_path / "model")  # given: nothing to materialize
    port = free_port()
    seen = {}

    def plan(c: Config, run_dir: Path, task: str = "train"):
        seen["run_dir"] = run_dir
        return [engine_spec(run_dir, port), trainer_spec(run_dir, steps=2)]

    console, out = capture()
    assert run_training(cfg, console=console, plan_builder=plan) == 0
    run_dir = seen["run_dir"]
    loaded = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(run_dir / "config.yaml"))
    assert loaded.train.steps == 2 and loaded.model.path == cfg.model.path
    assert loaded.run.dir == str(run_dir) and run_dir.is_absolute()
    assert "step 2/2" in out.getvalue()
    assert_all_gone(written_pids(run_dir))


def test_a_failed_push_ends_with_76_and_a_counted_requeue_until_max_requeues(tmp_path):
    """The trainer recorded a push that spent the engines: the run ends with FAILED_PUSH_EXIT and node 0
    allows a requeue (the record says so); past cluster.max_requeues it exits 1. A record an earlier launch
    left is removed before anything starts."""
    cfg = _cfg(tmp_path / "run")
    cfg.model.path = str(tmp_path / "model")
    cfg.cluster.max_requeues = 1
    port = free_port()
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir()
    (run_dir / "FAILED_PUSH").write_text('{"step": 9, "requeue": true}\n')  # an earlier launch's

    def plan(c: Config, run_dir: Path, task: str = "train"):
        return [engine_spec(run_dir, port), trainer_spec(run_dir, steps=1, mode=mode)]

    mode = "fail"  # an ordinary failure: the earlier record neither counts nor stays
    assert run_training(cfg, console=capture()[0], plan_builder=plan) == 3
    assert not (run_dir / "FAILED_PUSH").exists()
    mode = "failed_push"
    console, out = capture()
    assert run_training(cfg, console=console, plan_builder=plan) == FAILED_PUSH_EXIT
    text = out.getvalue()
    assert "the weight push of step 2 failed on engines whose weight post-processing is not" in text
    assert "requeue 1 of cluster.max_requeues=1 (exit 76)" in text and re.search(r"status +failed_push", text)
    record = json.loads((run_dir / "FAILED_PUSH").read_text())
    assert (record["step"], record["requeue"], record["requeues"]) == (2, True, 1)
    console, out = capture()
    assert run_training(cfg, console=console, plan_builder=plan) == 1  # the bound is reached
    assert (
        "requeued 1 times after failed pushes already (cluster.max_requeues=1): not again" in out.getvalue()
    )
    assert json.loads((run_dir / "FAILED_PUSH").read_text())["requeue"] is False
    assert_all_gone(written_pids(run_dir))


def test_process_names_must_be_unique(tmp_path):
    spec = trainer_spec(tmp_path)
    with pytest.raises(ValueError, match="unique"):
        Supervisor([spec, spec], tmp_path)


def test_live_display_on_a_terminal(tmp_path):
    out = io.StringIO()
    console = Console(file=out, width=120, force_terminal=True, color_system=None)
    specs = [engine_spec(tmp_path, free_port()), trainer_spec(tmp_path, steps=3)]
    assert supervisor(specs, tmp_path, console, live=True).run() == 0
    text = out.getvalue()
    assert "3/3" in text and "grad norm" in text and "where the time went" in text
    assert "step 1/3 |" not in text  # the live table replaces per-step lines
    assert_all_gone(written_pids(tmp_path))


SUPERVISOR = """
import sys
from pathlib import Path
from rich.console import Console
sys.path[:0] = [sys.argv[2], str(Path(sys.argv[2]).parent)]  # test_supervisor and the free_ports it imports
import test_supervisor as t
run_dir = Path(sys.argv[1])
specs = [t.engine_spec(run_dir, int(sys.argv[3])), t.trainer_spec(run_dir, steps=1, mode="hang")]
t.Supervisor(specs, run_dir, console=Console(stderr=True)).run()
"""


def test_supervisor_killed_by_sigkill_takes_its_children_along(tmp_path):
    """PDEATHSIG: a supervisor killed outright still gets its direct children a SIGTERM."""
    args = [sys.executable, "-c", SUPERVISOR, str(tmp_path), str(Path(__file__).parent), str(free_port())]
    sup = subprocess.Popen(args, stderr=subprocess.DEVNULL)
    try:
        leaders = [int(wait_for(tmp_path / f).split()[0]) for f in ("engine-0.pids", "trainer.pids")]
    finally:
        sup.kill()
        sup.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(running(pid) for pid in leaders):
        time.sleep(0.05)
    gone = not any(running(pid) for pid in leaders)
    for pid in written_pids(tmp_path):  # grandchildren are beyond PDEATHSIG's reach: clean up here
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)  # reparented to this (subreaper) test process
    assert gone


def running(pid: int) -> bool:
    """Alive and not a zombie (orphans reparented to a parent that never reaps stay zombies)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# --- multi-node: remote engines, rollout-only nodes and the DONE marker -----------------------------


@contextlib.contextmanager
def remote_engine(port: int, healthy_after_s: float = 0.0):
    """An engine 'on another node': an HTTP server in this process, healthy after a delay (inf: never)."""
    start = time.monotonic()

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            ok = self.path == "/health_generate" and time.monotonic() - start >= healthy_after_s
            self.send_response(200 if ok else 503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}/health_generate"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_trainer_node_waits_for_remote_engines_then_writes_done(tmp_path):
    console, out = capture()
    with remote_engine(free_port(), healthy_after_s=0.5) as url:
        marker = DoneMarker(tmp_path)
        sup = supervisor([trainer_spec(tmp_path)], tmp_path, console, remote_engines=[("engine-2", url)])
        sup.done_marker = marker
        assert sup.run() == 0
    text = out.getvalue()
    assert "waiting for 1 engine(s) (1 on other nodes)" in text
    assert text.index("engines healthy after") < text.index("started trainer")
    assert read_status(tmp_path / "DONE") == "finished"
    assert_all_gone(written_pids(tmp_path))


def test_unhealthy_remote_engine_fails_before_the_trainer_starts(tmp_path):
    console, out = capture()
    with remote_engine(free_port(), healthy_after_s=float("inf")) as url:
        sup = supervisor(
            [trainer_spec(tmp_path)],
            tmp_path,
            console,
            startup_timeout_s=1.0,
            remote_engines=[("engine-2", url)],
            done_marker=DoneMarker(tmp_path),
        )
        assert sup.run() == 1
    text = out.getvalue()
    assert "engine-2 (on another node) is not healthy" in text and "HTTP 503" in text
    assert str(tmp_path / "logs" / "engine-2.log") in text
    assert not (tmp_path / "logs" / "trainer.log").exists()
    assert read_status(tmp_path / "DONE") == "failed"  # so the rollout nodes stop too


def test_failed_trainer_on_node_0_writes_a_failed_marker(tmp_path):
    console, _ = capture()
    specs = [engine_spec(tmp_path, free_port()), trainer_spec(tmp_path, steps=1, mode="fail")]
    assert supervisor(specs, tmp_path, console, done_marker=DoneMarker(tmp_path)).run() == 3
    assert read_status(tmp_path / "DONE") == "failed"


def rollout_node(tmp_path: Path, console: Console) -> Supervisor:
    """A node that only runs an engine and watches for the DONE marker."""
    return supervisor(
        [engine_spec(tmp_path, free_port())], tmp_path, console, done_marker=DoneMarker(tmp_path)
    )


def in_watch_loop(out: io.StringIO, action) -> threading.Thread:
    """Run `action` in a thread once the rollout node's supervisor watches for the marker."""

    def run():
        deadline = time.monotonic() + 20
        while "serving rollouts until" not in out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.02)
        action()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_rollout_node_exits_0_when_the_trainer_finishes(tmp_path):
    console, out = capture()
    write_marker(tmp_path / "DONE", "failed")  # an earlier run's marker: ignored
    sup = rollout_node(tmp_path, console)
    stale_seen = []

    def finish():
        time.sleep(0.3)  # several polls of the watch loop with the old marker in place
        stale_seen.append(sup.children[0].proc.poll() is None)  # still serving despite the old marker
        write_marker(tmp_path / "DONE", "finished")

    thread = in_watch_loop(out, finish)
    assert sup.run() == 0
    thread.join()
    assert stale_seen == [True]
    text = out.getvalue()
    assert "serving rollouts until" in text and "the trainer finished" in text
    assert sup.children[0].proc.returncode == -signal.SIGTERM  # its engine was stopped
    assert_all_gone(written_pids(tmp_path))


def test_rollout_node_fails_when_the_run_failed(tmp_path):
    console, out = capture()
    sup = rollout_node(tmp_path, console)
    thread = in_watch_loop(out, lambda: write_marker(tmp_path / "DONE", "failed"))
    assert sup.run() == 1
    thread.join()
    assert "the run ended with status 'failed'" in out.getvalue()
    assert_all_gone(written_pids(tmp_path))


def test_rollout_node_fails_when_its_engine_dies(tmp_path):
    console, out = capture()
    sup = rollout_node(tmp_path, console)

    def kill_engine():
        os.kill(int(wait_for(tmp_path / "engine-0.pids").split()[0]), signal.SIGKILL)

    thread = in_watch_loop(out, kill_engine)
    assert sup.run() == 128 + signal.SIGKILL
    thread.join()
    text = out.getvalue()
    assert "engine-0 was killed by SIGKILL" in text and "this node only serves rollouts" in text
    assert not (tmp_path / "DONE").exists()  # a rollout node never writes the marker
    assert_all_gone(written_pids(tmp_path))


def _two_node_cfg(run_dir: Path, node_rank: int) -> Config:
    """Node 0 trains, node 1 serves one engine; both 'nodes' are this machine."""
    cfg = _cfg(run_dir)
    cfg.model.path = str(run_dir.parent / "model")  # given: nothing to materialize
    cfg.cluster.nnodes, cfg.cluster.node_rank = 2, node_rank
    cfg.cluster.node_addrs = ["127.0.0.1", "127.0.0.1"]
    cfg.parallel.rollout.nnodes = 1
    cfg.engine.host = "0.0.0.0"
    return cfg


def test_run_training_on_a_rollout_node_stops_at_done(tmp_path):
    cfg = _two_node_cfg(tmp_path / "run", node_rank=1)
    run_dir = (tmp_path / "run").resolve()
    console, out = capture()
    thread = in_watch_loop(out, lambda: write_marker(run_dir / "DONE", "finished"))
    code = run_training(cfg, console=console, plan_builder=lambda c, d, **_: [engine_spec(d, c.engine.port)])
    thread.join()
    assert code == 0, out.getvalue()
    assert (run_dir / "config-node1.yaml").is_file() and not (run_dir / "config.yaml").exists()
    assert "step " not in out.getvalue()  # only node 0 shows progress
    assert_all_gone(written_pids(run_dir))


def test_run_training_on_node_0_waits_for_the_rollout_node(tmp_path):
    cfg = _two_node_cfg(tmp_path / "run", node_rank=0)
    run_dir = (tmp_path / "run").resolve()
    run_dir.mkdir()
    write_marker(run_dir / "DONE", "finished")  # an earlier run's: removed before anything starts
    console, out = capture()
    with remote_engine(cfg.engine.port, healthy_after_s=0.3):
        code = run_training(cfg, console=console, plan_builder=lambda c, d, **_: [trainer_spec(d, steps=2)])
    assert code == 0, out.getvalue()
    text = out.getvalue()
    assert "1 on other nodes" in text and "step 2/2" in text
    assert read_status(run_dir / "DONE") == "finished" and "wrote" in text
    assert (run_dir / "config-node0.yaml").is_file()
    assert_all_gone(written_pids(run_dir))
