"""The supervisor's side of the fault files: the children's environment, clearing an earlier run's files,
and which heartbeats count (this node's live processes, other nodes' from the shared run dir)."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from dsv4rl.faults.files import LOG_DIR_ENV, PROCESS_ENV
from dsv4rl.launcher.child_faults import ChildFaults
from dsv4rl.launcher.plan import ProcessSpec


def spec(logs: Path, name: str, role: str) -> ProcessSpec:
    return ProcessSpec(name=name, argv=["true"], env={"A": "1"}, log_path=logs / f"{name}.log", role=role)


def write_beat(logs: Path, process: str, pid: int, host: str | None = None) -> None:
    beat = {"process": process, "pid": pid, "host": host or socket.gethostname(), "phase": "train",
            "step": 1, "since": 1.0, "progress_at": 1.0, "busy": False}  # fmt: skip
    (logs / f"heartbeat-{process}.json").write_text(json.dumps(beat))


def test_children_learn_where_and_as_whom_to_write(tmp_path):
    faults = ChildFaults([spec(tmp_path, "engine-0", "engine")])
    env = faults.env(faults.specs[0])
    assert env == {"A": "1", LOG_DIR_ENV: str(tmp_path), PROCESS_ENV: "engine-0"}


def test_clear_removes_only_the_childrens_heartbeats_and_crash_reports(tmp_path):
    names = ["heartbeat-trainer-rank0.json", "crash-trainer-rank3.json", "crash-trainer.json"]
    names += [
        "heartbeat-engine-1.json",
        "heartbeat-engine-10.json",
        "stacks-trainer-rank0.txt",
        "trainer.log",
    ]
    for name in names:
        (tmp_path / name).write_text("{}")
    ChildFaults([spec(tmp_path, "trainer", "trainer"), spec(tmp_path, "engine-1", "engine")]).clear()
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["heartbeat-engine-10.json", "stacks-trainer-rank0.txt", "trainer.log"]


def test_which_heartbeats_count(tmp_path):
    faults = ChildFaults([spec(tmp_path, "trainer", "trainer")], remote_engines=["engine-2"])
    write_beat(tmp_path, "trainer-rank0", os.getpid())  # live, here
    write_beat(tmp_path, "trainer-rank1", 999_999)  # here, but no process of this run
    write_beat(tmp_path, "trainer-rank2", 7, host="node-1")  # another node's rank
    write_beat(tmp_path, "engine-2", 8, host="node-1")  # an engine on another node
    write_beat(tmp_path, "engine-3", 9, host="node-1")  # nobody this node knows
    seen = {item.beat.process: item for item in faults.heartbeats(alive={os.getpid()})}
    assert sorted(seen) == ["engine-2", "trainer-rank0", "trainer-rank2"]
    assert seen["trainer-rank0"].local and not seen["trainer-rank2"].local
    assert (seen["engine-2"].role, seen["trainer-rank2"].role) == ("engine", "trainer")
    assert faults.dump_stacks([seen["trainer-rank2"]], "test", wait_s=0.1) == {}  # never signals elsewhere
