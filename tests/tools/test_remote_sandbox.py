"""The remote sandbox client (SandboxFusion's /run_code) against a local test double of that API
(tests/tools/sandbox_fusion_service.py), started for real on loopback: results, timeouts, memory, the
service's failures (retried or not), the concurrency bound, and the probe that refuses a wrong URL."""

from __future__ import annotations

import asyncio

import pytest
from sandbox_fusion_service import ServiceState, serve

from dsv4rl.tools import remote_sandbox
from dsv4rl.tools.remote_sandbox import (
    RemoteRun,
    SandboxFusionClient,
    SandboxServiceError,
    probe_service,
    read_response,
)
from free_ports import free_port


@pytest.fixture(scope="module")
def service():
    with serve() as (base, state):
        yield base, state


@pytest.fixture
def url(service) -> str:
    base, state = service
    state.reset()
    return f"{base}/run_code"


@pytest.fixture
def state(service) -> ServiceState:
    return service[1]


def client(url: str, fault: str | None = None, **options) -> SandboxFusionClient:
    options.setdefault("backoff_s", 0.01)
    return SandboxFusionClient(url, headers={"X-Fault": fault} if fault else None, **options)


def run(remote: SandboxFusionClient, *codes: str, run_timeout_s: float = 5.0, memory_mb: int = -1):
    """The runs of `codes`, all at once, on one event loop; the client closed after."""

    async def go() -> list[RemoteRun]:
        try:
            return await asyncio.gather(*(remote.run(c, run_timeout_s, memory_mb) for c in codes))
        finally:
            await remote.aclose()

    results = asyncio.run(go())
    return results[0] if len(codes) == 1 else results


def test_stdout_then_stderr_and_the_exit_code(url: str) -> None:
    result = run(client(url), "import sys\nprint('out')\nprint('err', file=sys.stderr)\nsys.exit(3)")
    assert result == RemoteRun("out\nerr\n", 3, False, False, None, result.time_s)
    assert result.time_s > 0


def test_an_exception_reaches_the_output_with_a_nonzero_exit(url: str) -> None:
    result = run(client(url), "print('before')\nraise ValueError('boom')")
    assert result.exit_code == 1 and result.sandbox_error is None and not result.timed_out
    assert result.output.startswith("before\nTraceback (most recent call last):")
    assert result.output.rstrip().endswith("ValueError: boom")


def test_time_limit_exceeded_is_timed_out(url: str) -> None:
    result = run(client(url), "print('started', flush=True)\nwhile True:\n    pass", run_timeout_s=0.5)
    assert result.timed_out and result.exit_code is None and result.sandbox_error is None
    assert result.output == "started\n" and not result.memory_exceeded


def test_memory_error_under_the_limit_is_memory_exceeded(url: str) -> None:
    result = run(client(url), "x = bytearray(1 << 30)", memory_mb=200)
    assert result.memory_exceeded and result.exit_code == 1 and "MemoryError" in result.output
    assert not run(client(url), "x = bytearray(1 << 20)", memory_mb=200).memory_exceeded


def test_503_then_success_is_retried(url: str, state: ServiceState) -> None:
    result = run(client(url, "http:503:2", retries=2), "print(6 * 7)")
    assert result.output == "42\n" and result.exit_code == 0 and result.sandbox_error is None
    assert state.seen["http:503:2"] == 3


def test_gateway_timeouts_past_the_retries_are_a_sandbox_error(url: str, state: ServiceState) -> None:
    result = run(client(url, "http:504", retries=2), "print(1)")
    assert result.exit_code is None and not result.timed_out
    assert "HTTP 504" in result.sandbox_error and "after 3 attempts" in result.sandbox_error
    assert url in result.sandbox_error and "remote.url" in result.sandbox_error
    assert state.seen["http:504"] == 3


@pytest.mark.parametrize("status", [400, 422])
def test_a_4xx_is_not_retried(url: str, state: ServiceState, status: int) -> None:
    result = run(client(url, f"http:{status}", retries=3), "print(1)")
    assert f"HTTP {status}" in result.sandbox_error and "a 4xx is not retried" in result.sandbox_error
    assert state.seen[f"http:{status}"] == 1


def test_an_unknown_language_is_the_services_422_not_retried(url: str, state: ServiceState) -> None:
    result = run(client(url, language="cobol", retries=3), "print(1)")
    assert "HTTP 422" in result.sandbox_error and state.requests == 1


def test_sandbox_error_is_run_again_then_reported(url: str, state: ServiceState) -> None:
    once = run(client(url, "sandbox-error:1", retries=1), "print('second try')")
    assert once.output == "second try\n" and once.sandbox_error is None
    always = run(client(url, "sandbox-error", retries=1), "print(1)")
    assert "answered SandboxError" in always.sandbox_error and "(after 2 attempts)" in always.sandbox_error
    assert "executor pod went away" in always.sandbox_error
    assert state.seen["sandbox-error"] == 2


def test_an_answer_that_is_not_json_is_a_sandbox_error(url: str, state: ServiceState) -> None:
    result = run(client(url, "not-json", retries=3), "print(1)")
    assert "not JSON" in result.sandbox_error and "502 Bad Gateway" in result.sandbox_error
    assert state.seen["not-json"] == 1


def test_a_post_past_timeout_s_is_retried_then_a_sandbox_error(
    url: str, state: ServiceState, monkeypatch
) -> None:
    monkeypatch.setattr(remote_sandbox, "SERVICE_MARGIN_S", 0.1)  # a short POST timeout, for a fast test
    result = run(client(url, "slow:0.6", timeout_s=0.3, retries=1), "print(1)", run_timeout_s=0.1)
    assert "no answer within timeout_s=0.3 (after 2 attempts" in result.sandbox_error and not result.timed_out
    assert state.seen["slow:0.6"] == 2


def test_service_down_is_a_sandbox_error_after_the_retries() -> None:
    url = f"http://127.0.0.1:{free_port()}/run_code"
    result = run(client(url, retries=2), "print(1)")
    assert "cannot connect" in result.sandbox_error and "after 3 attempts" in result.sandbox_error
    assert result.exit_code is None and result.output == ""


def test_concurrency_bound(url: str, state: ServiceState) -> None:
    results = run(client(url, "hold:2", max_concurrency=2), *(f"print({i})" for i in range(6)))
    assert [r.output for r in results] == [f"{i}\n" for i in range(6)]
    assert state.max_in_flight["hold:2"] == 2 and state.seen["hold:2"] == 6


def test_probe_accepts_the_service(url: str) -> None:
    probe_service(url, memory_mb=512, retries=0)


def test_probe_refuses_a_wrong_url(url: str, service) -> None:
    base = service[0]
    for wrong in (f"{base}/run_cod", base):  # a typo; the service's address without the endpoint
        with pytest.raises(SandboxServiceError, match=rf"at {wrong} .*full URL of SandboxFusion's /run_code "
                           r"endpoint .*It gave: .*HTTP 404"):  # fmt: skip
            probe_service(wrong, retries=0)
    down = f"http://127.0.0.1:{free_port()}/run_code"
    with pytest.raises(SandboxServiceError, match=r"HOST=0\.0\.0\.0.*It gave: .*cannot connect"):
        probe_service(down, retries=0)
    with pytest.raises(SandboxServiceError, match=r"MB=1\): it answered exit code -?\d+.*memory_mb"):
        probe_service(url, memory_mb=1, retries=0)  # python cannot start in 1 MB


def test_probe_from_inside_an_event_loop(url: str) -> None:
    async def go() -> None:
        probe_service(url, retries=0)

    asyncio.run(go())


@pytest.mark.parametrize("bad", ["", "sandbox:8080/run_code", "ftp://host/run_code", "http://", None])
def test_a_bad_url_is_refused_at_construction(bad) -> None:
    with pytest.raises(ValueError, match="must be an http:// or https:// URL .*e.g. http://sandbox-host"):
        SandboxFusionClient(bad)


def test_bad_options_are_refused_at_construction() -> None:
    bad = [
        ({"timeout_s": 0.5}, "timeout_s=0.5"),
        ({"retries": -1}, "retries=-1"),
        ({"max_concurrency": 0}, "max_concurrency=0"),
        ({"headers": {"a": 1}}, "headers"),
    ]
    for options, message in bad:
        with pytest.raises(ValueError, match=message):
            SandboxFusionClient("http://127.0.0.1:1/run_code", **options)


def test_a_run_timeout_that_cannot_fit_in_a_post_is_refused(url: str, state: ServiceState) -> None:
    remote = client(url, timeout_s=5)
    assert remote.timeout_problem(3.0) is None
    assert "make it at least 11" in remote.timeout_problem(10.0)
    with pytest.raises(ValueError, match=r"remote.timeout_s=5 leaves no room"):
        run(remote, "print(1)", run_timeout_s=10.0)
    assert state.requests == 0


def test_read_response_follows_the_published_shapes() -> None:
    url = "http://sandbox/run_code"
    compiled = {"status": "Finished", "return_code": 1, "stdout": "", "stderr": "e"}
    compile_error = {"status": "Failed", "message": "", "run_result": None, "compile_result": compiled}
    assert read_response(compile_error, url, 0.1) == RemoteRun("e", 1, False, False, None, 0.1)
    killed = {"status": "Failed", "message": "", "run_result": {"status": "Finished", "return_code": 137}}
    assert read_response(killed, url, 0.1).memory_exceeded
    error = {"status": "SandboxError", "message": "oops",
             "run_result": {"status": "Error", "stderr": "exception on running command"}}  # fmt: skip
    assert "answered SandboxError: 'oops'" in read_response(error, url, 0.1).sandbox_error
    for odd in [[], {"status": "Done"}, {"status": "Success"}, {"status": "Success", "run_result": {}}]:
        assert read_response(odd, url, 0.1).sandbox_error.startswith(f"sandbox service {url} ")


# --- the python tool with isolation: remote ---------------------------------------------------------


def tool_calls(tool, *codes: str):
    from dsv4rl.tools.python_tool import PythonTool  # noqa: F401  (the tool under test)

    async def go():
        state = await tool.open(None)
        try:
            return [await tool.call(state, {"code": c}) for c in codes]
        finally:
            await tool.close(state)

    return asyncio.run(go())


def test_the_python_tool_runs_on_the_service(url, state):
    from dsv4rl.tools.python_tool import PythonTool

    tool = PythonTool(timeout_s=3, memory_mb=256, isolation="remote", remote={"url": url, "timeout_s": 10})
    assert tool.isolation == "remote" and "files do not persist" in tool.describe()
    assert "do not persist either" in tool.schema["description"]
    ok, raised, slow = tool_calls(tool, "print(6 * 7)", "1 / 0", "import time\ntime.sleep(10)")
    assert (ok.text, ok.error) == ("42\n", False)
    assert raised.error and "ZeroDivisionError" in raised.text and raised.text.endswith("exit status 1")
    assert slow.error and slow.timed_out and "timed out after 3 s" in slow.text


def test_the_python_tool_refuses_a_wrong_url_at_construction_and_raises_when_the_service_fails(url):
    from dsv4rl.tools.python_tool import PythonTool

    with pytest.raises(SandboxServiceError, match="Fix remote.url"):
        PythonTool(isolation="remote", remote={"url": url.replace("/run_code", "/nothing"), "timeout_s": 30})
    with pytest.raises(ValueError, match="goes with isolation: remote"):
        PythonTool(remote={"url": url})
    with pytest.raises(ValueError, match="unknown keys"):
        PythonTool(isolation="remote", remote={"url": url, "retry": 2})
    tool = PythonTool(timeout_s=3, isolation="remote", remote={"url": url, "timeout_s": 10, "retries": 1})
    tool.remote.headers["X-Fault"] = "http:503"  # the service fails from now on (the probe passed)
    tool.remote.backoff_s = 0.01
    with pytest.raises(RuntimeError, match="sandbox service"):
        tool_calls(tool, "print(1)")
