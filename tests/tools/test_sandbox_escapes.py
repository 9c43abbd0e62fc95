"""Hostile programs through the `python` tool (tests/tools/hostile.py), in every mode this machine accepts,
as root and as an unprivileged uid: each attempt fails and the call still returns a result the model can
read. The trusted mode, which isolates nothing, runs the same programs as the control: there they reach
the trainer, so the checks can see an escape."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from unprivileged import UID, can_run_as_unprivileged, unprivileged_argv

HOSTILE = Path(__file__).with_name("hostile.py")
SYSTEM_PYTHON = "/usr/bin/python3"  # readable by every uid, unlike a pyenv under /root
pytestmark = pytest.mark.slow


def run_harness(specs: list[str], tmp_path: Path, unprivileged: bool) -> dict:
    env = {
        **os.environ,
        "DSV4RL_ENGINE_ADMIN_API_KEY": "admin-" + os.urandom(8).hex(),
        "HF_TOKEN": "hf_" + os.urandom(8).hex(),
    }
    argv = [sys.executable, str(HOSTILE), *specs]
    if unprivileged:
        os.chown(tmp_path, UID, UID)
        argv = unprivileged_argv(argv, str(tmp_path))
        env["TMPDIR"] = str(tmp_path)
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def assert_contained(report: dict) -> list[str]:
    """Every accepted mode kept every program in; the modes that ran."""
    ran = []
    for spec, programs in report.items():
        if "_refused" in programs:
            assert "Fixes:" in programs["_refused"] or "trust_model_code" in programs["_refused"], programs
            continue
        ran.append(spec)
        for name, outcome in programs.items():
            if name.startswith("_"):
                continue
            assert outcome["escaped"] is None, f"{spec}: {name} {outcome['escaped']}: {outcome['text']}"
            assert outcome["text"].strip(), f"{spec}: {name} gave the model nothing to read"
    return ran


def test_hostile_programs_as_root(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("the root case (CI runs as root)")
    specs = ["namespaces", "landlock", "rlimits+trust"]
    if os.path.exists(SYSTEM_PYTHON):
        specs += [f"landlock:{SYSTEM_PYTHON}", f"rlimits+trust:{SYSTEM_PYTHON}"]
    report = run_harness(specs, tmp_path, unprivileged=False)
    trusted = {s: report.pop(s) for s in list(report) if s.startswith("rlimits+trust")}
    ran = assert_contained(report)
    assert ran, f"no mode isolates on this machine: {report}"
    for spec, programs in trusted.items():  # the control: nothing keeps these in
        if "_refused" in programs:
            continue
        escaped = {n for n, o in programs.items() if not n.startswith("_") and o["escaped"]}
        assert {"tcp_loopback", "udp_loopback", "unix_socket", "write_host_tmp", "io_uring"} <= escaped, (
            spec,
            escaped,
        )


def test_hostile_programs_as_an_unprivileged_uid(tmp_path):
    why = can_run_as_unprivileged()
    if why:
        pytest.skip(why)
    report = run_harness(["namespaces", "landlock", "rlimits+trust"], tmp_path, unprivileged=True)
    trusted = report.pop("rlimits+trust")
    ran = assert_contained(report)
    assert ran, f"no mode isolates on this machine for a plain user: {report}"
    if "_refused" not in trusted:  # same uid as the trainer, nothing in between: the control escapes
        escaped = {n for n, o in trusted.items() if not n.startswith("_") and o["escaped"]}
        assert {"read_secret_file", "read_engine_keys", "signal_trainer"} <= escaped, escaped
