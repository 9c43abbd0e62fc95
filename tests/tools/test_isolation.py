"""Which isolation the `python` tool gets, from what a node offers: every branch with made-up facts, and
the real probe on a node whose seccomp profile denies namespaces and Landlock (as many containers do)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from dsv4rl.tools.sandbox.isolation import (
    GUARANTEES,
    IsolationUnavailable,
    SandboxFacts,
    plan_isolation,
)

CGROUP = "cgroup v1 (/sys/fs/cgroup/memory/job, /sys/fs/cgroup/pids/job)"
FULL = SandboxFacts(
    root=True,
    namespaces=True,
    landlock_abi=7,
    seccomp=True,
    landlock_works=True,
    rlimits_works=True,
    cgroup=CGROUP,
)
NO_NAMESPACES = replace(FULL, namespaces=False, namespaces_error="unshare: Operation not permitted")


def test_auto_takes_namespaces_and_every_guarantee_has_a_layer():
    plan = plan_isolation(FULL, "auto", False, 64)
    assert plan.mode == "namespaces" and set(plan.layers) == set(GUARANTEES)
    assert plan.max_processes == 64 and plan.use_cgroup and plan.use_seccomp and not plan.notes
    assert "not isolated" not in plan.describe()


def test_auto_takes_landlock_where_namespaces_fail_never_rlimits():
    plan = plan_isolation(NO_NAMESPACES, "auto", False, 64)
    assert plan.mode == "landlock" and "Landlock" in plan.layers["files"]
    assert "seccomp" in plan.layers["network"]


def test_auto_refuses_when_nothing_isolates_naming_what_is_missing_and_the_fixes():
    facts = replace(NO_NAMESPACES, landlock_abi=0, landlock_works=False)
    with pytest.raises(IsolationUnavailable) as caught:
        plan_isolation(facts, "auto", False, 64)
    message = str(caught.value)
    assert "unshare: Operation not permitted" in message and "no Landlock" in message
    for fix in ("user namespaces", "isolation: landlock", "isolation: remote", "trust_model_code: true"):
        assert fix in message


@pytest.mark.parametrize(
    "facts,missing",
    [
        (replace(NO_NAMESPACES, landlock_abi=2), "Landlock ABI 3+"),
        (
            replace(NO_NAMESPACES, seccomp=False, seccomp_error="pip install pyseccomp"),
            "pip install pyseccomp",
        ),
        (replace(NO_NAMESPACES, root=False, landlock_abi=4), "signals from the trainer"),
        (
            replace(NO_NAMESPACES, landlock_works=False, landlock_error="No module named 'resource'"),
            "resource",
        ),
    ],
)
def test_landlock_lacking_a_layer_is_refused(facts, missing):
    with pytest.raises(IsolationUnavailable, match="landlock") as caught:
        plan_isolation(facts, "landlock", False, 8)
    assert missing in str(caught.value)
    with pytest.raises(IsolationUnavailable):
        plan_isolation(facts, "auto", False, 8)


def test_landlock_without_root_needs_scoping_and_then_holds():
    plan = plan_isolation(replace(NO_NAMESPACES, root=False, landlock_abi=6), "landlock", False, 8)
    assert "signal scoping" in plan.layers["processes"] and "uid" not in plan.layers["processes"]


def test_without_a_cgroup_a_call_is_held_to_one_process_and_the_plan_says_so():
    as_root = plan_isolation(replace(FULL, cgroup=None, cgroup_error="read-only"), "auto", False, 64)
    assert (
        as_root.max_processes == 1 and not as_root.allow_fork and "RLIMIT_NPROC" in as_root.layers["memory"]
    )
    assert "forced from 64 to 1" in as_root.describe() and "read-only" in as_root.describe()
    user = replace(FULL, root=False, cgroup=None)
    plan = plan_isolation(user, "auto", False, 64)
    assert plan.max_processes == 1 and "seccomp refuses fork" in plan.layers["memory"] and plan.use_seccomp
    with pytest.raises(IsolationUnavailable, match="a bound on memory"):
        plan_isolation(replace(user, seccomp=False), "namespaces", False, 64)


def test_rlimits_needs_trust_and_then_says_what_it_does_not_isolate():
    with pytest.raises(IsolationUnavailable, match="trust_model_code: true"):
        plan_isolation(FULL, "rlimits", False, 8)
    plan = plan_isolation(FULL, "rlimits", True, 8)
    assert plan.mode == "rlimits" and plan.layers["network"] == "not isolated" and not plan.use_seccomp
    with pytest.raises(IsolationUnavailable, match="trial run"):
        plan_isolation(replace(FULL, rlimits_works=False, rlimits_error="unreadable"), "rlimits", True, 8)


def test_namespaces_requested_where_they_fail_is_refused():
    with pytest.raises(IsolationUnavailable, match="namespaces do not work here"):
        plan_isolation(NO_NAMESPACES, "namespaces", False, 8)


# A node whose seccomp profile refuses unshare (EPERM) and has no Landlock (ENOSYS), as Docker's default
# profile without CAP_SYS_ADMIN and an older kernel give: the real probe, the real tool.
LOCKED_NODE = """
import errno, json, sys
import pyseccomp as sc
f = sc.SyscallFilter(sc.ALLOW)
f.add_rule(sc.ERRNO(errno.EPERM), "unshare")
if sys.argv[1] == "no-landlock":
    f.add_rule(sc.ERRNO(errno.ENOSYS), "landlock_create_ruleset")
f.load()
from dsv4rl.tools.python_tool import PythonTool
try:
    tool = PythonTool(isolation="auto", python=sys.argv[2] if len(sys.argv) > 2 else None)
    print(json.dumps({"mode": tool.isolation}))
except Exception as error:
    print(json.dumps({"refused": f"{type(error).__name__}: {error}"}))
"""


def locked_node(*args: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", LOCKED_NODE, *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_auto_refuses_on_a_node_without_namespaces_or_landlock():
    outcome = locked_node("no-landlock")
    assert "refused" in outcome, outcome
    assert outcome["refused"].startswith("IsolationUnavailable")
    assert (
        "namespaces: namespaces do not work here" in outcome["refused"]
        and "no Landlock" in outcome["refused"]
    )


@pytest.mark.skipif(not os.path.exists("/usr/bin/python3"), reason="needs an interpreter every uid can read")
def test_auto_takes_landlock_when_only_unshare_fails():
    outcome = locked_node("landlock", "/usr/bin/python3")
    assert outcome == {"mode": "landlock"} or "landlock" in outcome.get("refused", ""), outcome
    assert outcome.get("mode") != "rlimits"
