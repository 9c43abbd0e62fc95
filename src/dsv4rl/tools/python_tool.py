"""The built-in `python` tool: the model runs Python code, each call in a fresh sandboxed interpreter.

One trajectory owns one scratch directory (`open` makes it, `close` removes it): it is the code's working
directory, HOME and TMPDIR, so files persist between the calls of a trajectory, variables do not (each
call is a new `python -I` process: no user site-packages, no PYTHON* variables, a minimal environment
without the trainer's secrets; the interpreter's own packages, e.g. a venv's numpy, stay importable).

What holds where (`python_tool_availability()` tells which case this machine is in):

- Always: a wall-clock timeout after which the whole process group is SIGKILLed and reaped (the event
  loop never blocks); RLIMIT_AS (`memory_mb`: a too big allocation raises MemoryError), RLIMIT_CPU
  (`cpu_s`), RLIMIT_NPROC (`max_processes`), RLIMIT_FSIZE (64 MB a file), RLIMIT_NOFILE (256) and no core
  files; no_new_privs; an audit hook that refuses `open` outside the scratch directory and the
  interpreter, and non-AF_UNIX sockets. The hook gives the model a clear error but is no security
  boundary (ctypes gets around it).
- Run as root (as here): each trajectory gets its own unprivileged uid, so RLIMIT_NPROC applies (the
  kernel never enforces it for uid 0), the host's files are guarded by their permissions as well, the code
  cannot write outside the scratch directory and world-writable places, and every process of that uid
  is killed after each call and at `close` (nothing outlives a call, even with setsid).
- isolation="namespaces", or "auto" where `unshare` works (probed once per interpreter): a net namespace
  (only a loopback that is down: no network at all), a pid namespace (killing its first process kills
  every process of the call) and a mount namespace whose root is a read-only minimal tree (/usr, /bin,
  /lib*, /etc, the interpreter's directories, a few /dev nodes, its own /proc, 64 MB tmpfs /tmp and
  /dev/shm) with the scratch directory the only writable place on disk; the rest of the host's files
  (/root, /home, /work, other /tmp entries) are absent. Not root: a user namespace instead, as its root
  without any capability. Namespaces also lift the audit hook's ban on starting programs.
- isolation="rlimits", or "auto" where namespaces do not work: no network or file isolation beyond the
  audit hook (plus the separate uid when root); programs cannot be started through the `subprocess`/
  `os.system` family (audit hook). Not root: RLIMIT_NPROC counts every process of the user, so keep
  `max_processes` above what that user already runs, and a process that escapes the group with setsid
  survives the kill.
- Not enforced anywhere: disk usage of the scratch directory beyond 64 MB a file, and memory of tmpfs
  files (64 MB each for /tmp and /dev/shm under namespaces).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
import stat
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from dsv4rl.config.schema import SandboxIsolation, choice
from dsv4rl.tools import sandbox
from dsv4rl.tools.base import ToolResult

_UID_BASE = 0x70000000  # trajectories' uids when run as root: _UID_BASE + a random 24-bit number


def python_tool_availability(python: str | None = None) -> dict[str, Any]:
    """Which isolation layers the `python` tool gets on this machine (for the docs and `dsv4rl doctor`)."""
    return dict(sandbox.probe(python or sys.executable))


@dataclass
class PythonState:
    """One trajectory's sandbox: its scratch directory and (run as root) its own uid."""

    path: str
    uid: int | None = None
    active: int = 0


class _Output:
    """The combined stdout/stderr, bounded: the first and last `keep` bytes and the total count."""

    def __init__(self, keep: int):
        self.keep, self.head, self.tail, self.total = keep, bytearray(), bytearray(), 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.keep - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail += chunk
            del self.tail[: -self.keep]

    def text(self, max_chars: int) -> str:
        head = self.head.decode("utf-8", "replace")
        tail = self.tail.decode("utf-8", "replace")
        skipped = self.total - len(self.head) - len(self.tail)
        if not skipped:
            return truncate(head + tail, max_chars)
        half = max_chars // 2
        cut = max(0, len(head) - half) + skipped + max(0, len(tail) - (max_chars - half))
        tail = tail[len(tail) - (max_chars - half) :]
        return f"{head[:half]}\n[... about {cut} characters cut ...]\n{tail}"


def truncate(text: str, max_chars: int) -> str:
    """`text` cut to its first and last `max_chars / 2` characters around a marker saying how many went."""
    if len(text) <= max_chars:
        return text
    half = max_chars // 2
    tail = text[len(text) - (max_chars - half) :]
    return f"{text[:half]}\n[... {len(text) - max_chars} characters cut ...]\n{tail}"


class PythonTool:
    """Runs the model's Python code in a sandboxed interpreter (see the module docstring)."""

    name = "python"

    def __init__(self, timeout_s: float = 10.0, memory_mb: int = 1024, cpu_s: float | None = None,
                 max_output_chars: int = 4096, max_processes: int = 64, isolation: str = "auto",
                 python: str | None = None):  # fmt: skip
        isolation = choice(SandboxIsolation, isolation, "the python tool's isolation")
        self.timeout_s, self.memory_mb = float(timeout_s), int(memory_mb)
        self.max_output_chars = int(max_output_chars)
        self.cpu_s = float(cpu_s if cpu_s is not None else timeout_s)
        self.max_processes, self.python = int(max_processes), python or sys.executable
        self.availability = sandbox.probe(self.python)
        if isolation == SandboxIsolation.namespaces and not self.availability["namespaces"]:
            raise RuntimeError("python tool: isolation='namespaces' but namespaces do not work here: "
                               f"{self.availability.get('namespaces_error', '')}")  # fmt: skip
        self.namespaces = isolation != SandboxIsolation.rlimits and self.availability["namespaces"]
        self.isolation = "namespaces" if self.namespaces else "rlimits"
        self.schema = {
            "name": "python",
            "description": (
                "Run Python 3 code in a fresh, sandboxed interpreter and get its stdout and stderr back "
                f"(at most {max_output_chars} characters). Print what you want to see. Variables do not "
                "persist between calls; files written to the current directory do. No network access; "
                f"limits: {self.timeout_s:g} s, {self.memory_mb} MB."
            ),
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "The Python code to run."}},
                "required": ["code"],
            },
        }

    async def open(self, sample: Any) -> PythonState:
        path = tempfile.mkdtemp(prefix="dsv4rl-py-")
        uid = None
        if os.geteuid() == 0:
            uid = _UID_BASE + random.randrange(1 << 24)
            os.chown(path, uid, uid)
        return PythonState(path, uid)

    async def close(self, state: PythonState) -> None:
        if state.uid is not None:
            await asyncio.to_thread(sandbox.kill_uid, state.uid)
        await asyncio.to_thread(_remove, state.path)

    async def call(self, state: PythonState, args: dict[str, Any]) -> ToolResult:
        code = args.get("code") if isinstance(args, dict) else None
        if not isinstance(code, str):
            return ToolResult("error: the python tool takes one argument, 'code' (a string of Python code)",
                              error=True)  # fmt: skip
        limits = {"memory_mb": self.memory_mb, "cpu_s": self.cpu_s, "max_processes": self.max_processes}
        cfg = sandbox.base_config(state.path, self.python, self.namespaces, state.uid, **limits)
        argv = sandbox.command(self.python, cfg, self.availability["unshare"])
        start = time.monotonic()
        output = _Output(4 * self.max_output_chars + 16)
        state.active += 1
        try:
            code_rc, timed_out = await self._run(argv, code, state, output)
        finally:
            state.active -= 1
        elapsed = time.monotonic() - start
        text = output.text(self.max_output_chars)
        metrics = {"exit_code": float(code_rc), "time_s": elapsed}
        if code_rc == 0 and not timed_out:
            return ToolResult(text if text.strip() else "(no output)", metrics=metrics)
        reason = self._reason(code_rc, timed_out, text)
        timed_out = timed_out or code_rc == -signal.SIGXCPU
        text = f"{text.rstrip()}\n{reason}".lstrip()
        return ToolResult(text, metrics=metrics, error=True, timed_out=timed_out)

    async def _run(self, argv: list[str], code: str, state: PythonState, output: _Output) -> tuple[int, bool]:
        env = {"PATH": f"{os.path.dirname(self.python)}:/usr/local/bin:/usr/bin:/bin", "HOME": state.path,
               "TMPDIR": state.path, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1",
               "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2",
               "MPLBACKEND": "Agg"}  # fmt: skip
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, cwd=state.path, env=env, start_new_session=True,
        )  # fmt: skip

        async def pump() -> None:
            while chunk := await proc.stdout.read(1 << 16):
                output.add(chunk)

        async def feed_and_wait() -> None:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                proc.stdin.write(code.encode("utf-8", "surrogatepass"))
                await proc.stdin.drain()
                proc.stdin.close()
            await proc.wait()

        reader = asyncio.create_task(pump())
        timed_out = False
        try:
            await asyncio.wait_for(feed_and_wait(), self.timeout_s)
        except TimeoutError:
            timed_out = True
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # the call's whole process group, also after an exit
            if state.uid is not None and state.active == 1:  # no other call of this trajectory runs
                await asyncio.to_thread(sandbox.kill_uid, state.uid)
            try:
                await asyncio.wait_for(reader, 2.0)
            except TimeoutError:
                pass  # a process that left the group still holds the pipe: keep what came
            finally:
                if proc.stdin and not proc.stdin.is_closing():
                    proc.stdin.close()
            await proc.wait()
        return proc.returncode, timed_out

    def _reason(self, code_rc: int, timed_out: bool, text: str) -> str:
        if timed_out:
            return f"error: timed out after {self.timeout_s:g} s (process killed)"
        if code_rc == sandbox.SETUP_FAILED:
            return "error: the sandbox could not be set up (not the code's fault)"
        if code_rc == -signal.SIGXCPU:
            return f"error: killed (CPU time limit {self.cpu_s:g} s)"
        if code_rc == -signal.SIGKILL:
            return f"error: killed (memory limit {self.memory_mb} MB or CPU time limit {self.cpu_s:g} s)"
        if code_rc < 0:
            with contextlib.suppress(ValueError):
                return f"error: killed by {signal.Signals(-code_rc).name}"
            return f"error: killed by signal {-code_rc}"
        lines = text.rstrip().splitlines()
        if lines and lines[-1].startswith("MemoryError"):
            return f"error: exit status {code_rc} (MemoryError: memory limit {self.memory_mb} MB)"
        return f"error: exit status {code_rc}"


def _remove(path: str) -> None:
    """rmtree that also gets through directories the code made unreadable."""

    def retry(function: Any, failed: str, _exc: Any) -> None:
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(failed), stat.S_IRWXU)
            if os.path.isdir(failed) and not os.path.islink(failed):
                os.chmod(failed, stat.S_IRWXU)
            function(failed)

    shutil.rmtree(path, onerror=retry)
    if os.path.exists(path):
        shutil.rmtree(path, ignore_errors=True)
