"""Every recipe key's value is read or refused: each config group option and each enum value, composed into
tiny_arith, either fails validation naming its key, or validates and builds everything a run builds before
its first step (`every_value.py`, in a process of its own: the trainer backends need a process group)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from free_ports import free_port

SCRIPT = Path(__file__).with_name("every_value.py")
sys.path.insert(0, str(SCRIPT.parent))
from every_value import all_cases  # noqa: E402


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("every_value") / "cases.jsonl"
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(out)], capture_output=True, text=True, timeout=900, env=env
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    return {row["case"]: row for row in rows}


def test_the_cases_cover_every_group_option_and_enum_value(outcomes) -> None:
    cases = all_cases()
    assert set(outcomes) == set(cases)
    for expected in ("parallel.train.backend=megatron", "optim.name=adamw", "sync.pause_mode=in_place",
                     "reward.grader=math_verify", "parallel=cpu_fsdp2", "quant=fp8_mxfp4",
                     "reward.judge.on_error=fail",
                     "reward.fns=[{name: f, target: 'builtin:arith', on_error: exclude}]"):  # fmt: skip
        assert expected in outcomes


def test_a_value_that_validates_builds(outcomes) -> None:
    broken = {case: row["build_error"] for case, row in outcomes.items() if row["valid"] and not row["built"]}
    assert not broken, "\n\n".join(f"{case}: {error}" for case, error in broken.items())
    assert sum(row["built"] for row in outcomes.values()) >= 30


def test_a_refused_value_is_named(outcomes) -> None:
    for case, row in outcomes.items():
        if row["valid"]:
            continue
        key = case.split("=")[0]
        named = [error for error in row["errors"] if key.split("=[")[0] in error]
        assert named, f"{case} was refused without naming {key}: {row['errors']}"


def test_known_refusals(outcomes) -> None:
    """What CPU cannot honour is refused before start (the key and the fix named)."""
    for case in ("parallel.rollout.engine=sglang", "comm.backend=nccl", "cluster.device=mi355x"):
        assert not outcomes[case]["valid"], case
