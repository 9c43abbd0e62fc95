"""The built-in `python` tool: the model runs Python code, each call in a fresh sandboxed interpreter.

One trajectory owns one scratch directory (`open` makes it, `close` removes it): it is the code's working
directory, HOME and TMPDIR, so files persist between the calls of a trajectory, variables do not (each
call is a new `python -I` process: no user site-packages, no PYTHON* variables, an environment with none
of the trainer's variables; the interpreter's own packages, e.g. a venv's numpy, stay importable).

The isolation is decided once, when the tool is built (at validation): `isolation` auto | namespaces |
landlock | remote | rlimits (tools/sandbox/isolation.py lists the guarantees and which layer gives each).
`auto` takes namespaces, else landlock, and refuses where neither gives every guarantee; nothing falls
back at run time. `rlimits` isolates nothing but limits and cleanup, and needs `trust_model_code: true`.
A call whose sandbox cannot be set up raises (the rollout counts it as the tool's failure, not the
model's); the model's own errors, timeouts and limits come back as error results it can read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import stat
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from dsv4rl.config.choices import SandboxIsolation, choice
from dsv4rl.tools.base import ToolResult
from dsv4rl.tools.remote_sandbox import RemoteRun, SandboxFusionClient, probe_service
from dsv4rl.tools.sandbox import probe as sandbox
from dsv4rl.tools.sandbox.cgroups import CallCgroup, find_parent
from dsv4rl.tools.sandbox.isolation import IsolationPlan, SandboxFacts, plan_isolation, remote_plan
from dsv4rl.tools.sandbox.runner import SETUP_FAILED, SUPERVISORS
from dsv4rl.tools.sandbox.seccomp import seccomp_program
from dsv4rl.tools.sandbox.uids import UidClaim, claim_uid

log = logging.getLogger(__name__)
_TERM_GRACE_S = 2.0  # after its deadline the runner gets this long to kill its descendants, then SIGKILL


def sandbox_facts(python: str | None = None) -> SandboxFacts:
    """What this node offers the `python` tool's sandbox (for `dsv4rl doctor` and `dsv4rl plan`)."""
    return sandbox.probe(python or sys.executable)


@dataclass
class PythonState:
    """One trajectory's sandbox: its scratch directory and (run as root) a uid no other sandbox holds."""

    path: str
    claim: UidClaim | None = None
    active: int = 0

    @property
    def uid(self) -> int | None:
        return self.claim.uid if self.claim else None


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
                 trust_model_code: bool = False, python: str | None = None,
                 remote: dict[str, Any] | None = None, max_scratch_mb: int = 256):  # fmt: skip
        requested = choice(SandboxIsolation, isolation, "the python tool's isolation")
        self.timeout_s, self.memory_mb = float(timeout_s), int(memory_mb)
        self.max_output_chars = int(max_output_chars)
        self.cpu_s = float(cpu_s if cpu_s is not None else timeout_s)
        self.python = python or sys.executable
        self.max_scratch_mb = int(max_scratch_mb)
        if self.timeout_s <= 0 or self.memory_mb < 16 or int(max_processes) < 1:
            raise ValueError("python tool: timeout_s must be > 0, memory_mb >= 16 and max_processes >= 1 "
                             f"(got {timeout_s}, {memory_mb}, {max_processes})")  # fmt: skip
        if (remote is not None) != (requested == SandboxIsolation.remote):
            raise ValueError(
                "python tool: `remote: {url: ...}` goes with isolation: remote, and only with it"
            )
        self.remote: SandboxFusionClient | None = None
        if requested == SandboxIsolation.remote:
            self.remote = self._remote_client(remote)
            self.plan: IsolationPlan = remote_plan(self.remote.url)
        else:
            self.facts = sandbox.probe(self.python)
            self.plan = plan_isolation(self.facts, requested, bool(trust_model_code), int(max_processes))
            self.cgroup_parent = find_parent()[0] if self.plan.use_cgroup else None
            self.seccomp_bpf = seccomp_program(self.plan.allow_fork) if self.plan.use_seccomp else None
            self.unshare = shutil.which("unshare")
        self.isolation = str(self.plan.mode)
        self.max_processes = self.plan.max_processes
        log.info("python tool: isolation %s", self.describe())
        for note in self.plan.notes:
            log.warning("python tool: %s", note)
        files = "do not persist either" if self.remote else "written to the current directory do"
        self.schema = {
            "name": "python",
            "description": (
                "Run Python 3 code in a fresh, sandboxed interpreter and get its stdout and stderr back "
                f"(at most {max_output_chars} characters). Print what you want to see. Variables do not "
                f"persist between calls; files {files}. No network access; limits: {self.timeout_s:g} s, "
                f"{self.memory_mb} MB" + ("; no subprocesses." if self.max_processes == 1 else ".")
            ),
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "The Python code to run."}},
                "required": ["code"],
            },
        }

    def _remote_client(self, remote: Any) -> SandboxFusionClient:
        """The service's client, checked now (a test run of `print(1)`): a wrong URL fails validation."""
        if not isinstance(remote, dict) or not remote.get("url"):
            raise ValueError(
                "python tool: isolation: remote needs `remote: {url: http://host:8080/run_code}` (a "
                "SandboxFusion service; timeout_s, retries, max_concurrency and headers are optional)"
            )
        allowed = {"url", "timeout_s", "retries", "max_concurrency", "headers"}
        unknown = sorted(set(remote) - allowed)
        if unknown:
            raise ValueError(f"python tool: remote has unknown keys {unknown}; known: {sorted(allowed)}")
        client = SandboxFusionClient(**remote)
        problem = client.timeout_problem(self.timeout_s)
        if problem:
            raise ValueError(f"python tool: {problem}")
        probe_service(memory_mb=self.memory_mb, **remote)
        return client

    def describe(self) -> str:
        """The isolation as planned, for `dsv4rl plan` and the logs."""
        return self.plan.describe()

    async def open(self, problem: Any) -> PythonState:
        if self.remote is not None:
            return PythonState("")  # nothing on this node: each run is a fresh directory on the service
        path = tempfile.mkdtemp(prefix="dsv4rl-py-")
        claim = None
        if os.geteuid() == 0:
            try:
                claim = await asyncio.to_thread(claim_uid)
                os.chown(path, claim.uid, claim.uid)
            except BaseException:
                if claim is not None:
                    claim.release()
                _remove(path)
                raise
        return PythonState(path, claim)

    async def close(self, state: PythonState) -> None:
        if not state.path:
            return
        if state.claim is not None:
            await asyncio.to_thread(sandbox.kill_uid, state.claim.uid)
        await asyncio.to_thread(_remove, state.path)
        if state.claim is not None:  # only once its processes and files are gone
            state.claim.release()

    async def call(self, state: PythonState, args: dict[str, Any]) -> ToolResult:
        code = args.get("code") if isinstance(args, dict) else None
        if not isinstance(code, str):
            return ToolResult("error: the python tool takes one argument, 'code' (a string of Python code)",
                              error=True)  # fmt: skip
        if self.remote is not None:
            return self._remote_result(await self.remote.run(code, self.timeout_s, self.memory_mb))
        cfg = sandbox.runner_config(
            self.isolation, state.path, self.python, state.uid, memory_mb=self.memory_mb, cpu_s=self.cpu_s,
            max_processes=self.max_processes, seccomp_bpf=self.seccomp_bpf,
            landlock_abi=self.facts.landlock_abi,
        )  # fmt: skip
        argv = sandbox.command(self.python, cfg, self.unshare)
        start = time.monotonic()
        output = _Output(4 * self.max_output_chars + 16)
        cgroup = None
        if self.cgroup_parent is not None:
            cgroup = CallCgroup(self.cgroup_parent, self.memory_mb, self.max_processes + SUPERVISORS)
            try:
                cgroup.create()
            except OSError as error:
                cgroup.remove()
                raise RuntimeError(f"python tool: the call's cgroup could not be made ({error}); the "
                                   "sandbox does not run without it") from error  # fmt: skip
        state.active += 1
        try:
            code_rc, timed_out = await self._run(argv, code, state, output, cgroup)
            memory_hit = cgroup is not None and code_rc != 0 and cgroup.memory_exceeded()
        finally:
            state.active -= 1
            if cgroup is not None:
                await asyncio.to_thread(cgroup.remove)
        elapsed = time.monotonic() - start
        text = output.text(self.max_output_chars)
        if code_rc == SETUP_FAILED:
            raise RuntimeError(f"python tool: the sandbox could not be set up ({self.isolation}): "
                               f"{text.strip()[-300:]}")  # fmt: skip
        metrics = {"exit_code": float(code_rc), "time_s": elapsed}
        scratch = await self._bound_scratch(state)
        if code_rc == 0 and not timed_out and not scratch:
            return ToolResult(text if text.strip() else "(no output)", metrics=metrics)
        reason = "\n".join(r for r in (self._reason(code_rc, timed_out, text, memory_hit), scratch) if r)
        timed_out = timed_out or code_rc == -signal.SIGXCPU
        text = f"{text.rstrip()}\n{reason}".lstrip()
        return ToolResult(text, metrics=metrics, error=True, timed_out=timed_out)

    async def _bound_scratch(self, state: PythonState) -> str:
        """RLIMIT_FSIZE bounds one file, not how many: a scratch directory over `max_scratch_mb` after a
        call is emptied, and the model told so (what one call writes meanwhile is bounded by its time)."""
        if state.active:  # another call of the trajectory still writes there: the last one checks
            return ""
        held = await asyncio.to_thread(_disk_usage, state.path)
        if held <= self.max_scratch_mb << 20:
            return ""
        await asyncio.to_thread(_empty, state.path)
        return (f"error: the working directory held {held >> 20} MB, over the {self.max_scratch_mb} MB "
                "allowed: its files were removed")  # fmt: skip

    def _remote_result(self, run: RemoteRun) -> ToolResult:
        if run.sandbox_error:  # the service failed after its retries: never scored as the model's error
            raise RuntimeError(f"python tool: {run.sandbox_error}")
        output = _Output(4 * self.max_output_chars + 16)
        output.add(run.output.encode("utf-8", "replace"))
        text = output.text(self.max_output_chars)
        metrics = {
            "exit_code": float(run.exit_code if run.exit_code is not None else -1),
            "time_s": run.time_s,
        }
        if run.exit_code == 0 and not run.timed_out:
            return ToolResult(text if text.strip() else "(no output)", metrics=metrics)
        if run.timed_out:
            reason = f"error: timed out after {self.timeout_s:g} s (process killed)"
        elif run.memory_exceeded:
            reason = f"error: killed (memory limit {self.memory_mb} MB)"
        else:
            reason = f"error: exit status {run.exit_code}"
        return ToolResult(f"{text.rstrip()}\n{reason}".lstrip(), metrics=metrics, error=True,
                          timed_out=run.timed_out)  # fmt: skip

    async def _run(self, argv: list[str], code: str, state: PythonState, output: _Output,
                   cgroup: CallCgroup | None) -> tuple[int, bool]:  # fmt: skip
        env = sandbox.sandbox_env(self.python, state.path)
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, cwd=state.path, env=env, start_new_session=True,
        )  # fmt: skip

        async def pump() -> None:
            while chunk := await proc.stdout.read(1 << 16):
                output.add(chunk)

        async def feed_and_wait() -> None:
            if cgroup is not None:  # before the code arrives: the runner forks nothing until it has read it
                try:
                    cgroup.add(proc.pid)
                except OSError as error:  # the code never runs outside its cgroup
                    raise RuntimeError(
                        f"python tool: the call could not join its cgroup ({error})"
                    ) from error
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
            if proc.returncode is None:  # the deadline (or a cancelled call): the runner kills its tree
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(proc.wait()), _TERM_GRACE_S)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # the call's whole process group, also after an exit
            if cgroup is not None:
                await asyncio.to_thread(cgroup.kill)
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

    def _reason(self, code_rc: int, timed_out: bool, text: str, memory_hit: bool) -> str:
        if code_rc == 0 and not timed_out:
            return ""
        if timed_out:
            return f"error: timed out after {self.timeout_s:g} s (process killed)"
        if memory_hit:
            return f"error: killed (memory limit {self.memory_mb} MB over all its processes)"
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


def _disk_usage(path: str) -> int:
    """Bytes of the files under `path` (allocated blocks: a sparse file counts what it holds)."""
    total = 0
    for folder, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(folder, name)).st_blocks * 512
    return total


def _empty(path: str) -> None:
    """Remove what `path` holds, keeping the directory (its owner and mode) for the next call."""
    for entry in os.listdir(path):
        full = os.path.join(path, entry)
        if os.path.isdir(full) and not os.path.islink(full):
            _remove(full)
        else:
            with contextlib.suppress(OSError):
                os.unlink(full)


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
