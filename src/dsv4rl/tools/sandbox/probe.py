"""The tool's side of the sandbox: the runner's command line and config, and the probe of what this node
offers (each layer tried for real, once per interpreter, then cached)."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from pathlib import Path

from dsv4rl.tools.sandbox import runner
from dsv4rl.tools.sandbox.cgroups import find_parent
from dsv4rl.tools.sandbox.isolation import SandboxFacts
from dsv4rl.tools.sandbox.seccomp import SeccompUnavailable, kernel_has_seccomp, seccomp_program
from dsv4rl.tools.sandbox.uids import claim_uid

_PROBING = threading.Lock()
_SOURCE: str | None = None
_DIRS: dict[str, list[str]] = {}
_FACTS: dict[str, SandboxFacts] = {}


def python_dirs(python: str) -> list[str]:
    """The directories an interpreter needs (its prefixes and the real location of its executable)."""
    if python in _DIRS:
        return _DIRS[python]
    query = (
        "import json, os, sys; print(json.dumps([sys.prefix, sys.base_prefix, sys.exec_prefix, "
        "sys.base_exec_prefix, os.path.dirname(os.path.realpath(sys.executable))]))"
    )
    out = subprocess.run([python, "-I", "-c", query], capture_output=True, text=True, timeout=30, check=True)
    dirs = sorted({os.path.realpath(d) for d in json.loads(out.stdout)} | set(json.loads(out.stdout)))
    _DIRS[python] = [d for d in dirs if not any(d.startswith(o + "/") for o in dirs)]
    return _DIRS[python]


def runner_config(
    mode: str,
    scratch: str,
    python: str,
    uid: int | None,
    *,
    memory_mb: int,
    cpu_s: float,
    max_processes: int,
    seccomp_bpf: str | None,
    landlock_abi: int,
) -> dict:
    """The runner's config (tools/sandbox/runner.py reads it)."""
    dirs = python_dirs(python)
    readable = [*dirs, *(f"/dev/{d}" for d in runner.DEVICES), *runner._READ_ONLY_SYSTEM]
    return {
        "mode": mode,
        "scratch": scratch,
        "python_dirs": dirs,
        "uid": uid,
        "gid": uid,
        "block_exec": mode == "rlimits",
        "write_paths": [scratch, "/dev/null"],
        "read_paths": readable,
        "tmpfs_mb": 64,
        "fsize_mb": 64,
        "memory_mb": memory_mb,
        "cpu_s": cpu_s,
        "max_processes": max_processes,
        "seccomp_bpf": seccomp_bpf,
        "landlock_abi": landlock_abi,
    }


def command(python: str, cfg: dict, unshare: str | None) -> list[str]:
    """The argv that runs the runner with `cfg`, under `unshare` in the namespaces mode."""
    global _SOURCE
    if _SOURCE is None:
        _SOURCE = Path(runner.__file__).read_text()
    argv = [python, "-I", "-c", _SOURCE, json.dumps(cfg)]
    if cfg["mode"] != "namespaces":
        return argv
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    return [unshare or "unshare", *user, "--net", "--mount", "--pid", *argv]


def sandbox_env(python: str, scratch: str) -> dict[str, str]:
    """The code's whole environment: nothing of the trainer's (no keys, no tokens)."""
    return {
        "PATH": f"{os.path.dirname(python)}:/usr/local/bin:/usr/bin:/bin",
        "HOME": scratch,
        "TMPDIR": scratch,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "MALLOC_ARENA_MAX": "2",
        "MPLBACKEND": "Agg",
    }


def kill_uid(uid: int) -> int:
    """SIGKILL every live process whose real uid is `uid` (a trajectory's own uid), until none is left
    (zombies are dead already: their parent or init reaps them)."""
    killed = 0
    for _ in range(50):
        found = 0
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if ":" in line)
                if int(fields["Uid"].split()[0]) == uid and fields["State"].split()[0] not in "ZX":
                    os.kill(int(entry), signal.SIGKILL)
                    found += 1
            except (OSError, KeyError, ValueError):
                continue
        killed += found
        if not found:
            break
    return killed


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 without Landlock (or where seccomp hides the syscall)."""
    libc = ctypes.CDLL(None, use_errno=True)
    version = libc.syscall(runner.LANDLOCK_NR[0], None, ctypes.c_size_t(0), 1)  # ..._VERSION flag
    return max(0, int(version))


def _trial(
    python: str, mode: str, unshare: str | None, seccomp_bpf: str | None, abi: int
) -> tuple[bool, str]:
    """Run a small program in `mode`, as a trajectory would; (it worked, what went wrong)."""
    # as root the trial runs under a claimed uid, as a trajectory does: cleaning up after it kills every
    # process of that uid, and with one fixed probe uid the ranks of a node probing at once killed each
    # other's trials and refused isolation at random
    claim = claim_uid() if os.geteuid() == 0 else None
    uid = claim.uid if claim else None
    scratch = tempfile.mkdtemp(prefix="dsv4rl-py-probe-")
    try:
        if uid is not None:
            os.chown(scratch, uid, uid)
        cfg = runner_config(
            mode,
            scratch,
            python,
            uid,
            memory_mb=1024,
            cpu_s=10,
            max_processes=64,
            seccomp_bpf=seccomp_bpf,
            landlock_abi=abi,
        )
        check = "os.getpid() == 2 and not os.path.exists('/home/.')" if mode == "namespaces" else "True"
        # modules the runner itself never imports: read from the interpreter's tree after the sandbox is set
        code = f"import fractions, os, statistics\nassert {check}\nprint('ok')"
        try:
            out = subprocess.run(
                command(python, cfg, unshare),
                input=code.encode(),
                capture_output=True,
                timeout=30,
                cwd=scratch,
                env=sandbox_env(python, scratch),
            )
        except (OSError, subprocess.SubprocessError) as error:
            return False, repr(error)
        if out.returncode == 0 and out.stdout.strip() == b"ok":
            return True, ""
        ended = f"killed by {signal.Signals(-out.returncode).name}" if out.returncode < 0 else ""
        said = (out.stdout + out.stderr).decode("utf-8", "replace").strip()[-400:]
        return False, "; ".join(part for part in (ended, said) if part) or f"exit status {out.returncode}"
    finally:
        if claim is not None:
            kill_uid(claim.uid)
        shutil.rmtree(scratch, ignore_errors=True)
        if claim is not None:
            claim.release()


def probe(python: str) -> SandboxFacts:
    """What this node offers the sandbox of `python` (cached per interpreter, probed once per process)."""
    with _PROBING:
        if python not in _FACTS:
            _FACTS[python] = _probe(python)
        return _FACTS[python]


def _probe(python: str) -> SandboxFacts:
    unreadable = ""
    if os.geteuid() == 0:  # the trajectories' uids must read the interpreter: a common miss is /root (0700)
        unreadable = (
            f" (the sandbox's uid must be able to read {python}'s directories {python_dirs(python)}: "
            "give the tool `python:` an interpreter every user can read, e.g. /usr/bin/python3 "
            "with the packages the model may import, or make those directories readable)"
        )
    seccomp, seccomp_error, program = False, "", None
    if not kernel_has_seccomp():
        seccomp_error = "the kernel has no seccomp filters"
    else:
        try:
            program = seccomp_program(allow_fork=True)
            seccomp = True
        except SeccompUnavailable as error:
            seccomp_error = str(error)
    unshare = shutil.which("unshare")
    namespaces, ns_error = (False, "no `unshare` on PATH (util-linux)")
    if unshare:  # as it will run: with the seccomp filter where there is one
        namespaces, ns_error = _trial(python, "namespaces", unshare, program, 0)
        if not namespaces and seccomp and _trial(python, "namespaces", unshare, None, 0)[0]:
            seccomp, program = False, None  # the filter is what failed: neither mode may count on it
            seccomp_error = f"the kernel refused the seccomp filter in a trial run: {ns_error}"
            namespaces, ns_error = True, ""
    abi = landlock_abi()
    landlock, landlock_error = False, "not tried (no Landlock or no seccomp)"
    if abi and seccomp:
        landlock, landlock_error = _trial(python, "landlock", None, program, abi)
        landlock_error += unreadable if landlock_error else ""
    rlimits, rlimits_error = _trial(python, "rlimits", None, None, 0)
    rlimits_error += unreadable if rlimits_error else ""
    parent, cgroup_error = find_parent()
    return SandboxFacts(
        root=os.geteuid() == 0,
        namespaces=namespaces,
        namespaces_error=ns_error,
        landlock_abi=abi,
        seccomp=seccomp,
        seccomp_error=seccomp_error,
        landlock_works=landlock,
        landlock_error=landlock_error,
        rlimits_works=rlimits,
        rlimits_error=rlimits_error,
        cgroup=parent.describe() if parent else None,
        cgroup_error=cgroup_error,
    )
