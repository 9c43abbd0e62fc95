"""`dsv4rl doctor`'s sandbox row on recorded nodes: what the python tool would get, and a FAIL where the
recipe's python tool cannot be isolated as configured (the same planning as validation)."""

from __future__ import annotations

import copy
import json
from dataclasses import asdict
from pathlib import Path

from dsv4rl.config.compose import compose
from dsv4rl.doctor.probe import RecordedProbe
from dsv4rl.doctor.report import run_checks
from dsv4rl.doctor.verdict import Status
from dsv4rl.tools.sandbox.isolation import SandboxFacts

STATE = json.loads((Path(__file__).parent / "states" / "cpu_only.json").read_text())
CONTAINER = SandboxFacts(
    root=True,
    namespaces=False,
    namespaces_error="unshare: Operation not permitted",
    landlock_abi=0,
    seccomp=True,
    rlimits_works=True,
    cgroup=None,
    cgroup_error="read-only /sys/fs/cgroup",
)
HOST = SandboxFacts(
    root=True,
    namespaces=True,
    landlock_abi=7,
    seccomp=True,
    landlock_works=True,
    rlimits_works=True,
    cgroup="cgroup v1 (/sys/fs/cgroup/memory/job, /sys/fs/cgroup/pids/job)",
)


def sandbox_row(facts: SandboxFacts | None, *overrides: str, recipe: str | None = None):
    state = copy.deepcopy(STATE)
    if facts is not None:
        state["sandbox"] = asdict(facts)
    cfg = compose(recipe, list(overrides)) if recipe else None
    report = run_checks(RecordedProbe(state), cfg)
    return report.by_name()["sandbox.python_tool"]


def test_not_recorded_is_skipped():
    assert sandbox_row(None).status == Status.SKIP


def test_without_a_recipe_it_says_what_auto_gets_or_warns():
    row = sandbox_row(HOST)
    assert row.status == Status.PASS and "isolation auto gets namespaces" in row.detail
    row = sandbox_row(CONTAINER)
    assert row.status == Status.WARN and "unshare: Operation not permitted" in row.detail
    assert "isolation: remote" in row.remedy


def test_the_recipes_python_tool_fails_where_it_cannot_be_isolated():
    row = sandbox_row(CONTAINER, recipe="dapo_math_tir")
    assert row.status == Status.FAIL and "isolation=auto cannot isolate" in row.detail
    row = sandbox_row(HOST, recipe="dapo_math_tir")
    assert row.status == Status.PASS and "the recipe's python tool gets namespaces" in row.detail
    assert "cgroup memory and pids limits per call" in row.detail
    row = sandbox_row(CONTAINER, "cluster.node_rank=1", recipe="dapo_math_tir")
    assert row.status == Status.SKIP and "node 0" in row.detail
