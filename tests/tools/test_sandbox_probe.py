"""The probe of what a node offers the sandbox, and the runner's end: several processes probing at once
(the ranks of a node) must not refuse isolation by killing each other's trials (each trial claims its uid:
tests/tools/test_sandbox_uids.py), and a program killed by SIGKILL ends its runner the same way, not in a
traceback."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from dsv4rl.tools.sandbox import probe

PROBE = """
import json, sys
from dsv4rl.tools.sandbox.probe import probe
facts = probe(sys.executable)
print(json.dumps({"namespaces": facts.namespaces, "error": facts.namespaces_error}))
"""


def test_processes_probing_at_once_all_get_the_nodes_answer():
    alone = probe.probe(sys.executable)
    runs = [
        subprocess.Popen([sys.executable, "-c", PROBE], stdout=subprocess.PIPE, text=True) for _ in range(4)
    ]
    answers = [json.loads(run.communicate(timeout=120)[0]) for run in runs]
    assert all(answer["namespaces"] == alone.namespaces for answer in answers), answers


@pytest.mark.parametrize("mode", ["rlimits", "namespaces"])
def test_a_program_killed_by_sigkill_ends_its_runner_by_sigkill(mode):
    if mode == "namespaces" and not probe.probe(sys.executable).namespaces:
        pytest.skip("namespaces do not work on this node (`dsv4rl doctor` says why)")
    scratch = tempfile.mkdtemp(prefix="dsv4rl-test-runner-")
    try:
        cfg = probe.runner_config(
            mode,
            scratch,
            sys.executable,
            None,
            memory_mb=1024,
            cpu_s=10,
            max_processes=16,
            seccomp_bpf=None,
            landlock_abi=0,
        )
        done = subprocess.run(
            probe.command(sys.executable, cfg, shutil.which("unshare")),
            input=b"import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
            capture_output=True,
            timeout=60,
            cwd=scratch,
            env=probe.sandbox_env(sys.executable, scratch),
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert done.returncode == -signal.SIGKILL, (done.returncode, done.stderr.decode()[-2000:])
    assert b"Traceback" not in done.stderr, done.stderr.decode()[-2000:]
