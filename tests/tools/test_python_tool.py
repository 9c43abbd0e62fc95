"""The built-in `python` tool: results, shared files, limits, isolation, cleanup, concurrency."""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile
import time

import pytest

from dsv4rl.tools.base import Tool
from dsv4rl.tools.python_tool import PythonTool, sandbox_facts, truncate
from dsv4rl.tools.sandbox.isolation import IsolationUnavailable

FACTS = sandbox_facts()
NAMESPACES = FACTS.namespaces
needs_namespaces = pytest.mark.skipif(not NAMESPACES, reason="namespaces do not work on this machine")
SYSTEM_PYTHON = "/usr/bin/python3"  # a uid of its own can read it (a pyenv under /root it cannot)


def _isolations() -> list:
    """(isolation, python) of each mode this machine accepts: the tests run in each."""
    modes = [pytest.param("namespaces", None, id="namespaces", marks=needs_namespaces)]
    landlock_python = SYSTEM_PYTHON if os.geteuid() == 0 and os.path.exists(SYSTEM_PYTHON) else None
    facts = sandbox_facts(landlock_python) if landlock_python or os.geteuid() else None
    works = facts is not None and facts.landlock_works
    skip = pytest.mark.skipif(not works, reason="landlock does not work here")
    modes.append(pytest.param("landlock", landlock_python, id="landlock", marks=skip))
    return modes


ISOLATIONS = _isolations()


def run_calls(tool: PythonTool, *codes: str):
    """Open a trajectory, run the calls one after another, close it; the results and the state."""

    async def go():
        state = await tool.open(None)
        try:
            return [await tool.call(state, {"code": c}) for c in codes], state
        finally:
            await tool.close(state)

    return asyncio.run(go())


def sandbox_processes(state) -> list[int]:
    """Pids of live processes of a trajectory: its uid (run as root) or its scratch path in their argv."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if fields["State"].split()[0] in "ZX":
            continue  # dead already, waiting for its parent or init to reap it
        uid = int(fields["Uid"].split()[0])
        if (state.uid is not None and uid == state.uid) or state.path.encode() in cmdline:
            pids.append(int(entry))
    return pids


def test_schema_and_protocol():
    tool = PythonTool(timeout_s=2)
    assert isinstance(tool, Tool)
    assert tool.name == "python" and tool.schema["name"] == "python"
    assert tool.schema["parameters"]["required"] == ["code"]
    assert tool.schema["parameters"]["properties"]["code"]["type"] == "string"
    assert tool.isolation in ("namespaces", "landlock") and tool.describe().startswith(tool.isolation)
    with pytest.raises(ValueError):
        PythonTool(isolation="docker")


@pytest.mark.parametrize("isolation,python", ISOLATIONS)
def test_print_and_files_shared_within_a_trajectory(isolation, python):
    tool = PythonTool(timeout_s=5, memory_mb=256, isolation=isolation, python=python)
    (first, second, third), state = run_calls(
        tool,
        "print(6 * 7)\nopen('notes.txt', 'w').write('kept')",
        "import os\nprint(open('notes.txt').read(), os.getcwd() == os.environ['HOME'])",
        "x = 1",
    )
    assert (first.text, first.error, first.metrics["exit_code"]) == ("42\n", False, 0.0)
    assert second.text == "kept True\n" and not second.error
    assert third.text == "(no output)"
    assert first.metrics["time_s"] > 0
    assert not os.path.exists(state.path), "close() removes the scratch directory"


def test_no_variables_across_calls_and_no_secrets_in_env():
    os.environ["DSV4RL_TEST_SECRET"] = "hunter2"
    try:
        (first, second), _ = run_calls(
            PythonTool(timeout_s=5), "x = 1", "import os\nprint('DSV4RL_TEST_SECRET' in os.environ)\nprint(x)"
        )
    finally:
        del os.environ["DSV4RL_TEST_SECRET"]
    assert second.error and "False" in second.text and "NameError" in second.text


def test_exception_and_syntax_error_give_tracebacks():
    (exc, syntax, exits), _ = run_calls(
        PythonTool(timeout_s=5),
        "print('before')\ndef f():\n    return 1 / 0\nf()",
        "def (:",
        "raise SystemExit(3)",
    )
    assert exc.error and not exc.timed_out
    assert exc.text.startswith("before\nTraceback")
    assert "return 1 / 0" in exc.text and "ZeroDivisionError: division by zero" in exc.text
    assert "exit status 1" in exc.text and exc.metrics["exit_code"] == 1.0
    assert "runner" not in exc.text and "sandbox" not in exc.text
    assert syntax.error and "SyntaxError" in syntax.text
    assert exits.error and exits.text == "error: exit status 3"


def test_bad_arguments_are_error_results():
    tool = PythonTool(timeout_s=2)

    async def go():
        state = await tool.open(None)
        try:
            return [await tool.call(state, args) for args in ({}, {"code": 3}, {"cmd": "print(1)"})]
        finally:
            await tool.close(state)

    for result in asyncio.run(go()):
        assert result.error and "'code'" in result.text


def test_infinite_loop_is_killed_and_reported():
    start = time.monotonic()
    (result,), state = run_calls(
        PythonTool(timeout_s=2, memory_mb=256), "print('spin', flush=True)\nwhile True: pass"
    )
    assert time.monotonic() - start < 6
    assert result.error and result.timed_out
    assert result.text.startswith("spin\n")
    assert "timed out after 2 s" in result.text or "CPU time limit" in result.text
    assert sandbox_processes(state) == []


def test_cpu_limit_below_the_wall_timeout():
    (result,), _ = run_calls(PythonTool(timeout_s=10, cpu_s=1, memory_mb=256), "while True: pass")
    assert result.error and result.timed_out and "CPU time limit 1 s" in result.text
    assert result.metrics["time_s"] < 9


def test_huge_allocation_is_refused():
    (result,), _ = run_calls(
        PythonTool(timeout_s=5, memory_mb=256), "x = bytearray(4 * 1024**3)\nprint('got it')"
    )
    assert result.error and "got it" not in result.text
    assert "MemoryError" in result.text and "memory limit 256 MB" in result.text


@pytest.mark.parametrize("isolation,python", ISOLATIONS)
def test_fork_bomb_is_stopped_without_leftovers(isolation, python):
    tool = PythonTool(timeout_s=2, memory_mb=256, max_processes=16, isolation=isolation, python=python)
    start = time.monotonic()

    async def go():
        state = await tool.open(None)
        try:
            result = await tool.call(state, {"code": "import os\nwhile True:\n    os.fork()"})
            return result, sandbox_processes(state), state
        finally:
            await tool.close(state)

    result, left, state = asyncio.run(go())
    assert time.monotonic() - start < 8
    assert result.error
    assert left == [], f"stray processes after the call: {left}"
    assert sandbox_processes(state) == []


def test_background_process_does_not_outlive_the_call():
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent done')"
    tool = PythonTool(timeout_s=3)

    async def go():
        state = await tool.open(None)
        try:
            return await tool.call(state, {"code": code}), sandbox_processes(state)
        finally:
            await tool.close(state)

    result, left = asyncio.run(go())
    assert result.text == "parent done\n" and left == []


def test_cancelled_call_leaves_no_processes():
    tool = PythonTool(timeout_s=30)

    async def go():
        state = await tool.open(None)
        try:
            task = asyncio.create_task(tool.call(state, {"code": "import time\ntime.sleep(30)"}))
            await asyncio.sleep(0.5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return sandbox_processes(state)
        finally:
            await tool.close(state)

    start = time.monotonic()
    assert asyncio.run(go()) == []
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("isolation,python", ISOLATIONS)
def test_files_outside_the_scratch_directory_are_not_readable(isolation, python):
    with tempfile.TemporaryDirectory() as other:
        secret = os.path.join(other, "secret.txt")
        with open(secret, "w") as f:
            f.write("the-secret-value")
        os.chmod(other, 0o755)
        os.chmod(secret, 0o644)  # readable by anyone: only the sandbox keeps it out
        code = f"print(open({secret!r}).read())"
        (result, listing), _ = run_calls(
            PythonTool(timeout_s=5, isolation=isolation, python=python),
            code,
            f"import os\nprint(os.listdir({other!r}))",
        )
    assert result.error and "the-secret-value" not in result.text
    assert "PermissionError" in result.text or "FileNotFoundError" in result.text
    assert "secret.txt" not in listing.text or "Error" in listing.text


@needs_namespaces
def test_mount_namespace_hides_files_even_without_the_audit_hook():
    with tempfile.TemporaryDirectory() as other:
        secret = os.path.join(other, "secret.txt")
        with open(secret, "w") as f:
            f.write("the-secret-value")
        os.chmod(other, 0o755)
        os.chmod(secret, 0o644)
        code = f"import subprocess\nprint(subprocess.run(['cat', {secret!r}], capture_output=True))"
        (result,), _ = run_calls(PythonTool(timeout_s=5, isolation="namespaces"), code)
    assert "No such file" in result.text and "the-secret-value" not in result.text.replace(secret, "")


def listening_socket() -> socket.socket:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    return server


@pytest.mark.parametrize("isolation,python", ISOLATIONS)
def test_sockets_fail(isolation, python):
    server = listening_socket()
    port = server.getsockname()[1]
    try:
        code = (
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')"
        )
        (result,), _ = run_calls(PythonTool(timeout_s=5, isolation=isolation, python=python), code)
        with pytest.raises(BlockingIOError):
            server.accept()
    finally:
        server.close()
    assert result.error and "connected" not in result.text.replace("create_connection", "")
    assert "network access is disabled" in result.text


@needs_namespaces
def test_net_namespace_and_seccomp_block_sockets_even_without_the_audit_hook():
    server = listening_socket()
    port = server.getsockname()[1]
    child = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1); print('connected')"
    code = (
        "import subprocess, sys\n"
        f"done = subprocess.run([sys.executable, '-c', {child!r}])\n"
        "print('rc', done.returncode)"
    )
    try:
        (result,), _ = run_calls(PythonTool(timeout_s=5, isolation="namespaces"), code)
        with pytest.raises(BlockingIOError):
            server.accept()
    finally:
        server.close()
    assert "rc 1" in result.text and ("OSError" in result.text or "PermissionError" in result.text)


def test_output_is_truncated_keeping_head_and_tail():
    code = "print('HEAD' + 'x' * 100000 + 'TAIL')"
    (result,), _ = run_calls(PythonTool(timeout_s=5, max_output_chars=1000), code)
    assert not result.error
    assert result.text.startswith("HEAD") and result.text.rstrip().endswith("TAIL")
    assert len(result.text) < 1100 and "characters cut" in result.text
    huge = "import sys\nfor _ in range(200):\n    sys.stdout.write('y' * 100000)\nprint('END')"
    (result,), _ = run_calls(PythonTool(timeout_s=10, max_output_chars=1000), huge)
    assert len(result.text) < 1100 and "about" in result.text and result.text.rstrip().endswith("END")
    assert truncate("abcdefghij", 4) == "ab\n[... 6 characters cut ...]\nij"


def test_concurrent_calls_do_not_block_the_event_loop():
    tool = PythonTool(timeout_s=10, memory_mb=256)

    async def go():
        states = [await tool.open(None) for _ in range(8)]
        ticks = 0
        done = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0.01)

        ticking = asyncio.create_task(ticker())
        start = time.monotonic()
        code = "import time\ntime.sleep(1.0)\nprint({})"
        results = await asyncio.gather(
            *(tool.call(s, {"code": code.format(i)}) for i, s in enumerate(states))
        )
        elapsed = time.monotonic() - start
        done.set()
        await ticking
        for s in states:
            await tool.close(s)
        return results, elapsed, ticks

    results, elapsed, ticks = asyncio.run(go())
    assert [r.text for r in results] == [f"{i}\n" for i in range(8)]
    assert elapsed < 6, "the calls ran one after another"
    assert ticks > 0.5 * elapsed / 0.01, f"the event loop was blocked ({ticks} ticks in {elapsed:.1f} s)"


def test_modes_are_refused_where_they_cannot_isolate():
    if NAMESPACES:
        assert PythonTool(isolation="namespaces").isolation == "namespaces"
    else:
        with pytest.raises(IsolationUnavailable, match="namespaces"):
            PythonTool(isolation="namespaces")
    with pytest.raises(IsolationUnavailable, match="trust_model_code: true"):
        PythonTool(isolation="rlimits")
    if os.geteuid() == 0 and not FACTS.rlimits_works:  # the uid of its own cannot read this interpreter
        with pytest.raises(IsolationUnavailable, match="must be able to read"):
            PythonTool(isolation="rlimits", trust_model_code=True)


@pytest.mark.parametrize("isolation,python", ISOLATIONS)
def test_one_process_runs_and_cannot_fork(isolation, python):
    tool = PythonTool(timeout_s=5, memory_mb=256, max_processes=1, isolation=isolation, python=python)
    (result,), _ = run_calls(tool, "import os\nprint('ran')\nos.fork()")
    assert result.text.startswith("ran\n") and "BlockingIOError" in result.text and result.error
    assert "no subprocesses" in tool.schema["description"]


def test_a_scratch_directory_over_its_bound_is_emptied_and_the_model_told():
    tool = PythonTool(timeout_s=10, memory_mb=256, max_scratch_mb=16)
    write = "for i in range(5):\n    open(f'f{i}', 'wb').write(b'x' * (5 << 20))\nprint('wrote')"
    (kept, over, after), state = run_calls(
        tool, "open('small', 'w').write('ok')", write, "import os\nprint(sorted(os.listdir('.')))"
    )
    assert not kept.error
    assert over.error and over.text.startswith("wrote\n") and "over the 16 MB allowed" in over.text
    assert after.text == "[]\n"


@needs_namespaces
def test_an_interpreter_under_tmp_stays_visible_in_the_new_root(tmp_path):
    """The namespaces mode mounts its own /tmp: a venv under the host's /tmp (a CI checkout) is bound in."""
    import subprocess
    import sys

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    tool = PythonTool(timeout_s=10, isolation="namespaces", python=str(venv / "bin" / "python"))
    code = "import subprocess, sys\nprint(sys.prefix)\nsubprocess.run([sys.executable, '-c', 'print(42)'])"
    (result,), _ = run_calls(tool, code)
    assert result.text == f"{venv}\n42\n", result.text
