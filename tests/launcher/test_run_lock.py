"""One launcher per run dir and node: a live holder refuses a second launcher before anything is written,
whatever its ports; a stale lock is taken over with a notice; the nodes of one run lock their own names;
an unwritable run dir is one line naming the fix. Also the start's other refusals and notices: every busy
port in one message, a malformed data file, and what resume does, on the console."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from test_supervisor import capture, engine_spec, trainer_spec, written_pids

from dsv4rl.config.choices import ResumeMode
from dsv4rl.config.compose import ConfigError
from dsv4rl.config.schema import Config
from dsv4rl.launcher.plan import PortInUse, check_ports, port_is_free
from dsv4rl.launcher.run import RunDirInUse, run_training
from dsv4rl.launcher.run_lock import RunDirLocked, RunDirUnwritable, RunLock, lock_path
from free_ports import free_port, free_ports

HOLDER = r"""
import sys, time
from dsv4rl.launcher.run_lock import RunLock
lock = RunLock(sys.argv[1], int(sys.argv[2]))
lock.acquire()
print("locked", flush=True)
sys.stdin.read()  # until the test closes it
lock.release()
"""


@pytest.fixture
def holder(tmp_path: Path):
    """Another launcher's lock on `tmp_path / "run"` (node 0), held by a live process."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path / "run"), "0"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "locked"
    yield proc
    proc.stdin.close()
    proc.wait(timeout=30)


def test_a_live_holder_refuses_a_second_launcher(tmp_path, holder) -> None:
    lock = RunLock(tmp_path / "run")
    record = lock.holder()
    assert record["pid"] == holder.pid and record["host"] == socket.gethostname()
    with pytest.raises(RunDirLocked, match=rf"in use by another dsv4rl train \(pid {holder.pid} on "):
        lock.acquire()
    assert json.loads(lock_path(tmp_path / "run").read_text())["pid"] == holder.pid  # untouched


def test_run_training_is_refused_before_anything_is_written_whatever_its_ports(tmp_path, holder) -> None:
    cfg = _cfg(tmp_path / "run")
    before = sorted(p.name for p in (tmp_path / "run").iterdir())
    with socket.socket() as busy:  # its ports are busy too: the lock is the reason named
        busy.bind(("127.0.0.1", cfg.engine.port))
        busy.listen()
        with pytest.raises(RunDirLocked, match=f"pid {holder.pid}"):
            run_training(cfg, console=capture()[0], plan_builder=_no_plan)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == before == ["lock-node0"]


def test_the_nodes_of_one_run_lock_their_own_names(tmp_path, holder) -> None:
    with RunLock(tmp_path / "run", node_rank=1) as lock:
        assert lock.acquire() is None
        assert lock_path(tmp_path / "run", 1).exists()


def test_a_stale_lock_is_taken_over_with_a_notice(tmp_path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    stale = {"status": "running", "host": socket.gethostname(), "pid": gone.pid, "node": 0, "time": 0}
    lock_path(run_dir).write_text(json.dumps(stale))
    lock = RunLock(run_dir)
    assert lock.holder() is None
    notice = lock.acquire()
    assert notice and f"pid {gone.pid} on {socket.gethostname()}" in notice and "took over" in notice
    assert json.loads(lock_path(run_dir).read_text())["pid"] == os.getpid()
    lock.release()
    assert json.loads(lock_path(run_dir).read_text())["status"] == "released"
    again = RunLock(run_dir)
    assert again.acquire() is None  # a released lock: no notice
    again.release()


def test_without_flock_a_live_holder_on_this_host_still_refuses(tmp_path, monkeypatch) -> None:
    """A filesystem that cannot lock (ENOLCK) or locks per host only: the record decides."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    live = {"status": "running", "host": socket.gethostname(), "pid": os.getppid(), "node": 0}
    lock_path(run_dir).write_text(json.dumps(live))

    def no_flock(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    with pytest.raises(RunDirLocked, match=f"pid {os.getppid()}"):
        RunLock(run_dir).acquire()
    live["host"] = "another-host"  # cannot be checked from here, no flock: taken over, with a notice
    lock_path(run_dir).write_text(json.dumps(live))
    lock = RunLock(run_dir)
    assert "another-host" in lock.acquire()
    lock.release()


def test_an_unwritable_run_dir_is_one_line_with_the_fix(tmp_path, monkeypatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(RunDirUnwritable) as info:
        RunLock(blocker / "run").acquire()
    message = str(info.value)
    assert "\n" not in message and f"run.dir {blocker / 'run'} cannot be written" in message
    assert "run.dir=PATH" in message

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(tmp_path / "ro"))

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(
        RunDirUnwritable, match="cannot be written: Read-only file system; choose a directory"
    ):
        RunLock(tmp_path / "ro").acquire()


def test_an_unwritable_run_dir_from_the_command_line(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    engine_port, master_port = free_ports(2)
    ports = [f"engine.port={engine_port}", f"cluster.master_port={master_port}"]
    argv = [
        sys.executable,
        "-m",
        "dsv4rl.cli",
        "train",
        "recipe=tiny_arith",
        f"run.dir={blocker}/run",
        *ports,
    ]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: run.dir {blocker}/run cannot be written: Not a directory; choose a directory you can write "
        "with run.dir=PATH, or fix its permissions"
    ]
    assert "Traceback" not in result.stdout + result.stderr


# ------------------------------------------------------------------------------------------- ports
def test_every_busy_port_is_named_in_one_refusal() -> None:
    cfg = Config()
    cfg.parallel.rollout.num_engines = 2
    cfg.engine.port, cfg.cluster.master_port, cfg.cluster.weight_sync_port = free_ports(3)
    busy = [cfg.engine.port + 1, cfg.cluster.master_port, cfg.cluster.weight_sync_port]
    holders = []
    try:
        for port in busy:
            sock = socket.socket()
            holders.append(sock)
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                pytest.skip(f"port {port} taken meanwhile")
            sock.listen()
        with pytest.raises(PortInUse) as info:
            check_ports(cfg)
    finally:
        for sock in holders:
            sock.close()
    message = str(info.value)
    assert message.startswith("3 ports are already in use: ")
    assert [port for port, _, _ in info.value.busy] == busy
    for port in busy:
        assert f"sport = :{port}" in message
    assert "(engine 1: engine.port + 1)" in message and "(torchrun master)" in message
    overrides = dict(item.split("=") for item in info.value.override.split())
    assert list(overrides) == ["engine.port", "cluster.master_port", "cluster.weight_sync_port"]
    moved = [int(overrides["engine.port"]), int(overrides["engine.port"]) + 1]
    moved += [int(overrides["cluster.master_port"]), int(overrides["cluster.weight_sync_port"])]
    assert len(set(moved)) == 4 and not set(moved) & set(busy)
    assert all(port_is_free("127.0.0.1", port) for port in moved)


# ------------------------------------------------------------------------------------------- data
def test_a_malformed_data_row_is_refused_before_anything_starts(tmp_path, monkeypatch) -> None:
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": \n')
    cfg = _cfg(tmp_path / "run")
    cfg.data.name, cfg.data.path = "custom", str(data)
    cfg.data.prompt_key, cfg.data.answer_key = "prompt", "answer"

    def no_popen(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr(subprocess, "Popen", no_popen)
    with pytest.raises(ConfigError, match=rf"data.path: {data}, line 2: invalid JSON"):
        run_training(cfg, console=capture()[0], plan_builder=_no_plan)
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------- resume
def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_resume_true_without_a_checkpoint_is_refused_and_the_run_dir_is_left_as_it_was(tmp_path) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)  # an earlier attempt that saved no checkpoint
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (run_dir / "logs" / "crash-trainer.json").write_text('{"type": "EngineError"}')
    (run_dir / "logs" / "trainer.log").write_text("step 2 ...\n")
    before = _tree(run_dir)
    cfg = _cfg(run_dir)
    cfg.resume = ResumeMode.true
    with pytest.raises(RunDirInUse, match="holds no checkpoint to continue from") as refused:
        run_training(cfg, console=capture()[0], plan_builder=_plan)
    assert "resume=false and a new run.dir" in str(refused.value) and "resume=auto" in str(refused.value)
    assert _tree(run_dir) == before  # byte for byte: nothing written, truncated or removed
    fresh = _cfg(tmp_path / "new")
    fresh.resume = ResumeMode.true
    with pytest.raises(RunDirInUse, match="holds no checkpoint"):  # nor on a run dir that is not there
        run_training(fresh, console=capture()[0], plan_builder=_plan)
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("mode", [ResumeMode.auto, ResumeMode.true])
def test_resume_continues_from_the_newest_checkpoint(tmp_path, mode) -> None:
    cfg = _cfg(tmp_path / "run")
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000004"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.pt").write_bytes(b"")
    cfg.resume = mode
    console, out = capture()
    assert run_training(cfg, console=console, plan_builder=_plan) == 0
    assert f"resume={mode}: continuing from {checkpoint}" in out.getvalue()


def test_resume_auto_without_a_checkpoint_starts_fresh_and_false_is_refused_with_one(tmp_path) -> None:
    cfg = _cfg(tmp_path / "run")
    cfg.resume = ResumeMode.auto
    console, out = capture()
    assert run_training(cfg, console=console, plan_builder=_plan) == 0
    assert "resume=auto: no checkpoint in" in out.getvalue()
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000002"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.pt").write_bytes(b"")
    cfg.resume = ResumeMode.false
    with pytest.raises(RunDirInUse, match="pass resume=auto"):
        run_training(cfg, console=capture()[0], plan_builder=_plan)


def test_a_new_attempt_keeps_the_earlier_ones_metrics_and_crash_records(tmp_path) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)  # an attempt that crashed at step 2 and saved no checkpoint
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (run_dir / "logs" / "crash-trainer-rank0.json").write_text('{"type": "EngineError"}')
    cfg = _cfg(run_dir)
    cfg.resume = ResumeMode.auto
    console, out = capture()
    assert run_training(cfg, console=console, plan_builder=_plan) == 0
    kept = run_dir / "attempts" / "1"
    assert (kept / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    assert (kept / "logs" / "crash-trainer-rank0.json").read_text() == '{"type": "EngineError"}'
    assert not (run_dir / "logs" / "crash-trainer-rank0.json").exists()  # cleared for the new attempt
    assert f"the earlier attempt's metrics and fault records: {kept}" in out.getvalue()


def test_an_earlier_stop_request_is_cleared_at_start(tmp_path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "STOP").write_text("")
    assert run_training(_cfg(tmp_path / "run"), console=capture()[0], plan_builder=_plan) == 0
    assert not (tmp_path / "run" / "STOP").exists()
    assert json.loads(lock_path(tmp_path / "run").read_text())["status"] == "released"


def _cfg(run_dir: Path) -> Config:
    cfg = Config()
    cfg.run.dir = str(run_dir)
    cfg.train.steps = 2
    cfg.model.path = str(run_dir.parent / "model")  # given: nothing to materialize
    cfg.engine.port, cfg.cluster.master_port, cfg.cluster.weight_sync_port = free_ports(3)
    return cfg


def _plan(cfg: Config, run_dir: Path, task: str = "train"):
    return [engine_spec(run_dir, free_port()), trainer_spec(run_dir, steps=2)]


def _no_plan(cfg: Config, run_dir: Path, task: str = "train"):
    raise AssertionError("the plan was built")


@pytest.fixture(autouse=True)
def _every_child_gone(tmp_path):
    yield
    for pid in written_pids(tmp_path / "run") if (tmp_path / "run").is_dir() else []:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
