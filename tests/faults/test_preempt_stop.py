"""The graceful stop's pieces: the STOP request, the STOPPED record, a trainer rank's own signals (the stack
dump on SIGUSR1 kept), and torchrun as the supervisor starts it (deaf to SIGTERM and SIGUSR1)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4rl.checks.validate import validate
from dsv4rl.config.choices import ResumeMode
from dsv4rl.config.compose import ConfigError, compose
from dsv4rl.faults.stop import (
    STOP_FILE,
    StoppedRecord,
    clear_stop_files,
    read_stop_request,
    request_stop,
    write_stopped,
)


def test_preempt_request_record_and_clear(tmp_path: Path) -> None:
    assert read_stop_request(tmp_path) is None
    request_stop(tmp_path, "SIGTERM to the supervisor")
    assert read_stop_request(tmp_path) == "SIGTERM to the supervisor"
    (tmp_path / STOP_FILE).write_text("")  # `touch STOP` by hand, or a batch script's trap
    assert read_stop_request(tmp_path) == f"{tmp_path / STOP_FILE} exists"

    write_stopped(tmp_path, 3, "old", "an earlier run")
    record = StoppedRecord(tmp_path)  # made by a supervisor at its start: the earlier record never counts
    assert record.read() is None
    write_stopped(tmp_path, 4, str(tmp_path / "checkpoints" / "step_00000004"), "SIGTERM")  # a new file
    assert record.read()["step"] == 4

    clear_stop_files(tmp_path)
    assert read_stop_request(tmp_path) is None and not (tmp_path / "STOPPED").exists()


RANK = r"""
import os, signal, sys, time
from pathlib import Path
from dsv4rl.faults.stacks import register_stack_dump
from dsv4rl.faults.stop import StopSignals
register_stack_dump(Path(sys.argv[1]), "trainer-rank0")
stop = StopSignals().install()
print("ready", flush=True)
while stop.reason is None:
    time.sleep(0.01)
print(f"asked: {stop.reason}", flush=True)
time.sleep(60)
"""


def _rank(tmp_path: Path) -> subprocess.Popen:
    stacks = tmp_path / "stacks-trainer-rank0.txt"
    proc = subprocess.Popen(
        [sys.executable, "-c", RANK, str(stacks)], stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_preempt_sigusr1_to_a_rank_asks_and_still_dumps_its_stacks(tmp_path: Path) -> None:
    proc = _rank(tmp_path)
    try:
        os.kill(proc.pid, signal.SIGUSR1)
        assert proc.stdout.readline().strip() == f"asked: SIGUSR1 to trainer pid {proc.pid}"
        stacks = (tmp_path / "stacks-trainer-rank0.txt").read_text()
        assert "most recent call first" in stacks  # faulthandler wrote first, then chained to the handler
        os.kill(proc.pid, signal.SIGUSR1)  # the second signal: at once
        assert proc.wait(timeout=30) == -signal.SIGTERM
    finally:
        proc.kill()


def test_preempt_a_second_sigterm_kills_the_rank_at_once(tmp_path: Path) -> None:
    proc = _rank(tmp_path)
    try:
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.stdout.readline().strip() == f"asked: SIGTERM to trainer pid {proc.pid}"
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
    finally:
        proc.kill()


TORCHRUN = r"""
import os, signal, sys
import torch.distributed.run
def fake_main():  # in torchrun's place: the handlers the wrapper left, then signals to itself
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGUSR1)
    print(os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"], flush=True)
torch.distributed.run.main = fake_main
from dsv4rl.train.torchrun import main
main()
"""


def test_preempt_torchrun_leaves_sigterm_and_sigusr1_to_its_ranks() -> None:
    result = subprocess.run([sys.executable, "-c", TORCHRUN], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "SIGINT,SIGHUP,SIGQUIT"  # SIGTERM not among them: not passed on


def test_preempt_recipe_keys_resume_modes_and_the_grace() -> None:
    """`resume` takes auto besides the bools it was (true/false keep working); run.stop_grace_s > 0."""
    modes = {
        text: compose("tiny_arith", [f"resume={text}"]).resume for text in ("true", "false", "auto", "True")
    }
    assert modes == {"true": "true", "false": "false", "auto": "auto", "True": "true"}
    assert [bool(mode) for mode in ResumeMode] == [False, True, True]  # `if cfg.resume:` as with the bool
    assert compose("tiny_arith", []).resume == ResumeMode.false
    with pytest.raises(ConfigError, match="resume: expected one of false, true, auto, got 'yes'"):
        compose("tiny_arith", ["resume=yes"])
    with pytest.raises(ConfigError, match=r"run.stop_grace_s must be > 0"):
        validate(compose("tiny_arith", ["run.stop_grace_s=0"]), check_paths=False)
