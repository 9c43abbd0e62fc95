"""The supervisor's hang watchdog and root causes, with small fake children that use `dsv4rl.faults` as
the real engine and trainer do (a hang injected through DSV4RL_INJECT_HANG, an exception, a rank killed
by a signal under a real torchrun), and one real trainer rank that fails on start."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import sys
from pathlib import Path

import pytest
from rich.console import Console

from dsv4rl.config.choices import ProcessRole
from dsv4rl.faults.inject import HANG_ENV, KILL_ENV
from dsv4rl.launcher.plan import ProcessSpec
from dsv4rl.launcher.supervisor import Supervisor
from free_ports import free_port

ENGINE = r"""
import http.server, os, sys, threading, urllib.parse
from dsv4rl.faults import heartbeat
from dsv4rl.faults.child import child_process

# One worker, as in the real engine: a health probe is a generate too and waits behind a batch.
# FAKE_LATE_PROBE=1: the supervisor's probes lose the race with the trainer's first generate.
worker, generated, probes = threading.Lock(), threading.Event(), []
late_probe = os.environ.get("FAKE_LATE_PROBE") == "1"

class Engine(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        status = 200
        if self.path == "/generate":
            generated.set()
            with worker, heartbeat.busy("generate"):
                pass
        elif self.path.startswith("/update_weights"):  # a weight update of session `step`
            step = int(urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)["step"][0])
            with worker, heartbeat.busy("weight_update", step):
                heartbeat.reached("weight_broadcast")
        elif self.path == "/health_generate":  # the supervisor's probe
            probes.append(1)
            if os.environ.get("FAKE_PROBE_503") == "1":  # the supervisor never sees it healthy itself
                status = 503
            elif late_probe and not generated.wait(timeout=1.0):
                status = 503
            elif worker.acquire(timeout=1.0):
                worker.release()
            else:
                status = 503
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass

with child_process("engine"):
    http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Engine).serve_forever()
"""

TRAINER = r"""
import sys, time, urllib.request
from dsv4rl.faults import heartbeat, notices
from dsv4rl.faults.child import child_process

port, mode = int(sys.argv[1]), sys.argv[2]

def generate():
    urllib.request.urlopen(f"http://127.0.0.1:{port}/generate", timeout=600).read()
    heartbeat.progress()  # as EngineClient does on every answer

def rollout(step):
    heartbeat.enter("rollout", step)
    slow = mode == "slow" and step == 1  # a 3 s rollout that keeps getting answers
    for _ in range(15 if slow else 1):
        generate()
        time.sleep(0.2 if slow else 0)

def train(step):
    heartbeat.enter("train", step)
    time.sleep(0.05)

def sync(step):
    heartbeat.enter("sync", step)
    urllib.request.urlopen(f"http://127.0.0.1:{port}/update_weights?step={step}", timeout=600).read()

def wait_for_engine():  # as the real trainer does: it starts with the engine and waits for it
    # (on /health, so that FAKE_LATE_PROBE delays only the supervisor's /health_generate probes)
    for _ in range(1200):
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).read()
        except OSError:
            time.sleep(0.05)
def run_steps():
    wait_for_engine()
    if mode == "notice":
        notices.notify("checkpoint step_2 cannot be loaded; falling back to step_1")
    for step in (1, 2, 3):
        rollout(step)
        train(step)
        sync(step)
    if mode == "raise":
        raise ValueError("the batch has no samples")

with child_process("trainer", rank=0):
    run_steps()
"""

RANK = r"""
import os, signal, sys, time
from dsv4rl.faults import heartbeat
from dsv4rl.faults.child import child_process

def train(rank, mode):
    heartbeat.enter("train", 1)
    if rank == 1 and mode == "kill":
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)  # rank 0: until torchrun stops it

with child_process("trainer", rank=int(os.environ["RANK"])):
    train(int(os.environ["RANK"]), sys.argv[1])
"""


def line_of(source: str, text: str) -> int:
    """The line of `text` in a `python -c` script, as its traceback numbers it."""
    return next(number for number, line in enumerate(source.splitlines(), 1) if text in line)


def spec(run_dir: Path, name: str, role: str, argv: list[str], **env: str) -> ProcessSpec:
    return ProcessSpec(
        name=name,
        argv=argv,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
        log_path=run_dir / "logs" / f"{name}.log",
        role=ProcessRole(role),
        health_url=f"http://127.0.0.1:{argv[-1]}/health_generate" if role == "engine" else None,
    )


def fake_run(run_dir: Path, mode: str = "ok", **env: str) -> list[ProcessSpec]:
    port = str(free_port())
    return [
        spec(run_dir, "engine-0", "engine", [sys.executable, "-c", ENGINE, port], **env),
        spec(run_dir, "trainer", "trainer", [sys.executable, "-c", TRAINER, port, mode], **env),
    ]


def torchrun(run_dir: Path, mode: str) -> ProcessSpec:
    script = run_dir / "rank.py"
    script.write_text(RANK)
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(free_port()), str(script), mode]  # fmt: skip
    return spec(run_dir, "trainer", "trainer", argv)


def supervise(specs: list[ProcessSpec], run_dir: Path, **kwargs) -> tuple[int, str, Supervisor]:
    out = io.StringIO()
    console = Console(file=out, width=200, force_terminal=False, color_system=None)
    sup = Supervisor(
        specs, run_dir, console=console, grace_s=5.0, poll_s=0.05, startup_timeout_s=30.0, **kwargs
    )
    code = sup.run()
    assert not sup.tracker.alive(), "a process outlived the run"
    return code, out.getvalue(), sup


def test_a_hung_trainer_makes_every_process_dump_its_stacks_then_the_run_stops(tmp_path):
    specs = fake_run(tmp_path, **{HANG_ENV: "trainer:train:2"})
    code, out, sup = supervise(specs, tmp_path, step_timeout_s=1.5)
    assert code == 1 and sup.hang is not None
    named = (
        r"hang: no progress for [\d.]+ s in phase train at step 2 \(run.step_timeout_s=1.5\): "
        r"trainer-rank0 did not advance, stuck in train at step 2"
    )
    assert re.search(named, out), out
    logs = tmp_path / "logs"
    assert f"Python stacks: {logs / 'stacks-trainer-rank0.txt'}\n" in out
    assert f"Python stacks: {logs / 'stacks-engine-0.txt'}\n" in out
    assert "no dump came" not in out
    trainer_stacks = (logs / "stacks-trainer-rank0.txt").read_text()
    assert "stacks requested: hang: no progress" in trainer_stacks
    assert "in train\n" in trainer_stacks and "in run_steps\n" in trainer_stacks  # where it hangs
    assert "in serve_forever" in (logs / "stacks-engine-0.txt").read_text()
    assert re.search(r"engine-0: idle for [\d.]+ s \(pid \d+\)", out)
    assert "status" in out and "hung" in out


def test_an_engine_stuck_in_generate_is_named_while_the_trainer_waits_in_rollout(tmp_path):
    specs = fake_run(tmp_path, **{HANG_ENV: "engine-0:generate"})
    code, out, _ = supervise(specs, tmp_path, step_timeout_s=1.5)
    assert code == 1
    named = (
        r"in phase rollout at step 1 \(run.step_timeout_s=1.5\): engine-0 did not advance, "
        r"busy in generate for [\d.]+ s while trainer-rank0 waits on it in rollout at step 1"
    )
    assert re.search(named, out), out
    engine_stacks = (tmp_path / "logs" / "stacks-engine-0.txt").read_text()
    assert "in do_GET" in engine_stacks and "in block_forever" in engine_stacks
    assert "in generate" in (tmp_path / "logs" / "stacks-trainer-rank0.txt").read_text()


def test_an_engine_stuck_in_the_trainers_first_generate_is_named_during_the_startup_wait(tmp_path):
    # The trainer starts with the engines and waits for them itself; its first generate can hang the
    # engine before the supervisor's own /health_generate wait is over. That wait never ends then, and the
    # hang must still be named after step_timeout_s, not reported as an engine that never became healthy.
    specs = fake_run(tmp_path, **{HANG_ENV: "engine-0:generate", "FAKE_LATE_PROBE": "1"})
    code, out, sup = supervise(specs, tmp_path, step_timeout_s=1.5)
    assert code == 1 and sup.hang is not None
    assert "engines healthy" not in out and "is not healthy" not in out, out
    named = (
        r"in phase rollout at step 1 \(run.step_timeout_s=1.5\): engine-0 did not advance, "
        r"busy in generate for [\d.]+ s while trainer-rank0 waits on it in rollout at step 1"
    )
    assert re.search(named, out), out
    assert "in block_forever" in (tmp_path / "logs" / "stacks-engine-0.txt").read_text()


def test_the_startup_wait_ends_once_the_trainer_is_past_its_own(tmp_path):
    """The trainer waits for its engines itself; once it has left its start phase the supervisor stops
    probing /health_generate (a real generation on SGLang: one that lands between a rollout and a colocated
    memory release makes the release fail), even if its own probes never saw the engine healthy."""
    code, out, sup = supervise(fake_run(tmp_path, "slow", FAKE_PROBE_503="1"), tmp_path, step_timeout_s=30)
    assert code == 0, out
    assert "the trainer is past its wait for the engines" in out and "is not healthy" not in out, out


def test_a_long_phase_that_keeps_progressing_is_no_hang(tmp_path):
    code, out, sup = supervise(fake_run(tmp_path, "slow"), tmp_path, step_timeout_s=2.0)
    assert code == 0 and sup.hang is None and "hang" not in out


def test_an_engine_stuck_in_a_weight_update_is_named_while_the_trainer_waits_in_sync(tmp_path):
    specs = fake_run(tmp_path, **{HANG_ENV: "engine-0:weight_update:2"})
    code, out, _ = supervise(specs, tmp_path, step_timeout_s=1.5)
    assert code == 1
    named = (
        r"in phase sync at step 2 \(run.step_timeout_s=1.5\): engine-0 did not advance, "
        r"busy in weight_update for [\d.]+ s while trainer-rank0 waits on it in sync at step 2"
    )
    assert re.search(named, out), out
    assert re.search(r"engine-0: busy in weight_update at step 2 for [\d.]+ s \(pid \d+\)", out), out
    engine_stacks = (tmp_path / "logs" / "stacks-engine-0.txt").read_text()
    assert "in do_GET" in engine_stacks and "in block_forever" in engine_stacks
    assert "in sync" in (tmp_path / "logs" / "stacks-trainer-rank0.txt").read_text()


def test_an_engine_killed_in_a_weight_broadcast_is_named_with_the_work_and_the_trainers_phase(tmp_path):
    """DSV4RL_INJECT_KILL: SIGKILL inside the engine's weight update of step 2, as a lost machine or the
    out-of-memory killer would: no exception, no crash report; the heartbeat says where it was."""
    specs = fake_run(tmp_path, **{KILL_ENV: "engine-0:weight_broadcast:2"})
    code, out, _ = supervise(specs, tmp_path, step_timeout_s=30)
    assert code == 128 + signal.SIGKILL, out
    assert (
        "✗ engine-0 was killed by SIGKILL (exit code -9) during weight_update at step 2; "
        "trainer-rank0 was in sync at step 2"
    ) in out, out
    assert f"{KILL_ENV}: engine-0 is killed in weight_broadcast at step 2 (test hook)" in out  # its log tail
    assert not (tmp_path / "logs" / "crash-engine-0.json").exists()


def test_a_childs_notice_reaches_the_console_once(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    earlier = {"process": "trainer-rank0", "message": "earlier run"}
    (logs / "notice-trainer-rank0.jsonl").write_text(json.dumps(earlier) + "\n")
    code, out, _ = supervise(fake_run(tmp_path, "notice"), tmp_path, step_timeout_s=30)
    assert code == 0, out
    assert out.count("! trainer-rank0: checkpoint step_2 cannot be loaded; falling back to step_1") == 1, out
    assert "earlier run" not in out


def test_a_trainer_exception_is_shown_as_the_root_cause(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    stale = {"process": "trainer-rank0", "pid": 1, "time": 1.0, "type": "OSError", "message": "earlier run",
             "frame": "x.py:1 in f", "project_frame": None, "traceback": ""}  # fmt: skip
    (logs / "crash-trainer-rank0.json").write_text(json.dumps(stale))
    code, out, _ = supervise(fake_run(tmp_path, "raise"), tmp_path, step_timeout_s=30)
    assert code == 1
    assert "trainer exited with code 1" in out and "earlier run" not in out
    raised_at = line_of(TRAINER, 'raise ValueError("the batch has no samples")')
    headline = f"ValueError: the batch has no samples (at <string>:{raised_at} in run_steps)"
    assert f"root cause: trainer-rank0: {headline}" in out
    assert "trainer-rank0's traceback" in out and f'File "<string>", line {raised_at}, in run_steps' in out
    assert "crash_report.py" not in out  # the traceback starts at the child's own code
    assert f"crash report: {logs / 'crash-trainer-rank0.json'}\nfull log: {logs / 'trainer.log'}\n" in out


def test_a_rank_killed_by_a_signal_is_named_from_torchrun(tmp_path):
    code, out, _ = supervise([torchrun(tmp_path, "kill")], tmp_path)
    assert code == 1
    assert re.search(
        r"root cause: trainer-rank1 \(pid \d+\) was killed by SIGKILL during train at step 1", out
    )
    assert "exitcode  : -9" in out  # torchrun's block in the log tail, below


@pytest.mark.slow
def test_the_real_trainer_failing_on_start_names_its_exception(tmp_path):
    """The training rank itself (torchrun -m dsv4rl.train.worker) with a config that is not there."""
    missing = tmp_path / "missing.yaml"
    torchrun_args = ["--nproc-per-node", "1", "--master-port", str(free_port())]
    argv = [sys.executable, "-m", "torch.distributed.run", *torchrun_args, "-m", "dsv4rl.train.worker"]
    argv += ["--config", str(missing)]
    code, out, _ = supervise([spec(tmp_path, "trainer", "trainer", argv)], tmp_path)
    assert code == 1
    assert re.search(
        rf"root cause: trainer-rank0: dsv4rl.config.compose.ConfigError: config file '{missing}' does not "
        r"exist \(at \S*src/dsv4rl/config/compose.py:\d+ in load_config_file\)",
        out,
    ), out
    assert "ChildFailedError" not in out  # torchrun's wrapper text gives way to the rank's own traceback
