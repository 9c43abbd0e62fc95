"""`child_process` in a real process: stacks on SIGUSR1, heartbeats, an injected hang, a crash report."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dsv4rl.faults.crash_report import read_crash_report
from dsv4rl.faults.files import LOG_DIR_ENV, PROCESS_ENV
from dsv4rl.faults.heartbeat import read_beat
from dsv4rl.faults.inject import HANG_ENV, KILL_ENV
from dsv4rl.faults.stacks import request_dump

CHILD = """
import sys
from dsv4rl.faults import heartbeat
from dsv4rl.faults.child import child_process

def train_steps():
    for step in (1, 2, 3):
        heartbeat.enter("train", step)
    if sys.argv[1] == "raise":
        raise RuntimeError("optimizer state is corrupt")

with child_process("trainer", rank=1) as name:
    print("name", name, flush=True)
    train_steps()
"""


def start(tmp_path: Path, mode: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, mode],
        env={**os.environ, LOG_DIR_ENV: str(tmp_path), PROCESS_ENV: "trainer", **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_until(check, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while not (result := check()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return result


def test_a_hung_child_dumps_its_stacks_on_request(tmp_path):
    child = start(tmp_path, "ok", **{HANG_ENV: "trainer:train:2"})
    try:
        beat = wait_until(
            lambda: (b := read_beat(tmp_path / "heartbeat-trainer-rank1.json")) and b.step == 2 and b
        )
        assert (beat.pid, beat.phase) == (child.pid, "train")
        time.sleep(0.3)
        assert child.poll() is None  # blocked in train at step 2
        stacks = tmp_path / "stacks-trainer-rank1.txt"
        assert request_dump(child.pid, stacks, "test") is not None
        text = wait_until(lambda: "train_steps" in (t := stacks.read_text()) and t)
    finally:
        child.kill()
        _, err = child.communicate()
    assert "trainer-rank1 (pid" in text and "stacks requested: test" in text
    assert "block_forever" in text and 'File "<string>", line 8 in train_steps' in text
    assert f"{HANG_ENV}: trainer-rank1 hangs in train at step 2 (test hook)" in err
    assert not (tmp_path / "crash-trainer-rank1.json").exists()


def test_an_injected_kill_ends_the_child_by_sigkill_at_its_point(tmp_path):
    child = start(tmp_path, "raise", **{KILL_ENV: "trainer:train:2"})
    _, err = child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL  # never got to raise
    assert f"{KILL_ENV}: trainer-rank1 is killed in train at step 2 (test hook)" in err
    beat = read_beat(tmp_path / "heartbeat-trainer-rank1.json")  # written before the kill: where it died
    assert (beat.phase, beat.step, beat.pid) == ("train", 2, child.pid)
    assert not (tmp_path / "crash-trainer-rank1.json").exists()


def test_an_exception_leaves_a_crash_report(tmp_path):
    child = start(tmp_path, "raise")
    out, err = child.communicate(timeout=60)
    assert child.returncode == 1 and "name trainer-rank1" in out and "optimizer state is corrupt" in err
    report = read_crash_report(tmp_path / "crash-trainer-rank1.json")
    assert (report.type, report.message, report.pid) == (
        "RuntimeError",
        "optimizer state is corrupt",
        child.pid,
    )
    assert report.frame == "<string>:10 in train_steps"
    assert read_beat(tmp_path / "heartbeat-trainer-rank1.json").step == 3


def test_without_a_supervisor_nothing_is_written(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in (LOG_DIR_ENV, PROCESS_ENV)}
    result = subprocess.run(
        [sys.executable, "-c", CHILD, "ok"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and "name None" in result.stdout
    assert not list(tmp_path.iterdir())
