"""Root causes from crash reports and from torchrun's failure block (text as torch 2.13 prints it)."""

from __future__ import annotations

import json
from dataclasses import asdict

from dsv4rl.faults.crash_report import build_report, short_path
from dsv4rl.launcher.root_cause import RankExit, find_root_cause, torchrun_failures

TORCHRUN_BLOCK = """
[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
======================================================
dsv4rl.train.worker FAILED
------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-01_07:03:09
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 1994)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 1994
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_07:03:09
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 1995)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 1995
======================================================
"""


def write_crash(log_dir, process: str, message: str, at: float) -> None:
    try:
        raise RuntimeError(message)
    except RuntimeError as error:
        report = asdict(build_report(error, process))
    report["time"] = at
    (log_dir / f"crash-{process}.json").write_text(json.dumps(report))


def test_torchrun_failures_root_cause_first():
    assert torchrun_failures(TORCHRUN_BLOCK) == [RankExit(1, 1, -9, 1995), RankExit(0, 0, -15, 1994)]
    assert torchrun_failures("Traceback ...\nValueError: x\n") == []


def test_a_rank_killed_by_a_signal_is_the_root_cause_over_its_peers_errors(tmp_path):
    write_crash(tmp_path, "trainer-rank0", "Connection closed by peer", at=2.0)  # the peer's consequence
    beat = {"process": "trainer-rank1", "pid": 1995, "host": "h", "phase": "train", "step": 7, "since": 1.0}
    (tmp_path / "heartbeat-trainer-rank1.json").write_text(json.dumps(beat))
    cause = find_root_cause(tmp_path, "trainer", TORCHRUN_BLOCK)
    assert cause.process == "trainer-rank1" and cause.traceback is None
    assert cause.headline.startswith(
        "trainer-rank1 (pid 1995) was killed by SIGKILL during train at step 7 (often the kernel's"
    )
    assert cause.others == [
        f"trainer-rank0: RuntimeError: Connection closed by peer (at {_frame()})"
    ]  # torchrun's SIGTERM of rank 0 is left out: rank 0 has its own report


def test_the_earliest_exception_is_the_root_cause(tmp_path):
    write_crash(tmp_path, "trainer-rank1", "second", at=5.0)
    write_crash(tmp_path, "trainer-rank0", "first", at=4.0)
    write_crash(tmp_path, "trainer-rank10", "ten", at=6.0)
    write_crash(tmp_path, "engine-0", "not the trainer's", at=1.0)
    (tmp_path / "crash-trainer-rank2.json").write_text("{broken")
    cause = find_root_cause(tmp_path, "trainer", "")
    assert cause.process == "trainer-rank0" and cause.source == tmp_path / "crash-trainer-rank0.json"
    assert cause.headline == f"trainer-rank0: RuntimeError: first (at {_frame()})"
    assert "RuntimeError: first" in cause.traceback
    assert [line.split(":")[0] for line in cause.others] == ["trainer-rank1", "trainer-rank10"]


def test_the_ranks_torchrun_stopped_are_left_out(tmp_path):
    write_crash(tmp_path, "trainer-rank1", "bad shard", at=3.0)
    block = TORCHRUN_BLOCK.replace("-9 (pid: 1995)  (SIGKILL)", "1 (pid: 1995)")  # rank 1 raised
    cause = find_root_cause(tmp_path, "trainer", block)
    assert cause.headline == f"trainer-rank1: RuntimeError: bad shard (at {_frame()})"
    assert cause.others == []  # rank 0, stopped by torchrun with SIGTERM, is no failure of its own


def test_a_rank_without_an_exception_is_named_from_torchrun(tmp_path):
    block = TORCHRUN_BLOCK.replace("-9 (pid: 1995)  (SIGKILL)", "3 (pid: 1995)")
    cause = find_root_cause(tmp_path, "trainer", block)
    assert cause.headline == "trainer-rank1 (pid 1995) exited with code 3 without a Python exception"
    assert cause.others == []
    assert find_root_cause(tmp_path, "trainer", "no block here") is None


def _frame() -> str:
    return f"{short_path(__file__)}:{write_crash.__code__.co_firstlineno + 2} in write_crash"
