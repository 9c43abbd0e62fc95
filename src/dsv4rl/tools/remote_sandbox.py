"""A client of a remote code sandbox speaking SandboxFusion's `POST /run_code` (the `python` tool's
`isolation: remote`), for clusters where nothing may be isolated locally.

The API, read from bytedance/SandboxFusion at commit 469de0845cb7d665bc68044d541aa3aa28c5b30a:

- request, `RunCodeRequest` (sandbox/server/sandbox_api.py): `code` (str), `language` (one of the
  `Language` literals of sandbox/runners/types.py, e.g. "python"), `compile_timeout` (float s, default
  10), `run_timeout` (float s, default 10), `memory_limit_MB` (int, default -1: none), `stdin` (str or
  null), `files` ({path: base64 content}), `fetch_files` ([path]). A field of the wrong type or an unknown
  language is FastAPI's HTTP 422.
- answer, `RunCodeResponse` (same file): `status` (`RunStatus`: "Success", "Failed", "SandboxError"),
  `message`, `compile_result` and `run_result` (each a `CommandRunResult` or null), `executor_pod_name`,
  `files` ({path: base64}). `CommandRunResult` (sandbox/runners/types.py): `status` (`CommandRunStatus`:
  "Finished", "Error", "TimeLimitExceeded"), `execution_time`, `return_code` (null on a timeout),
  `stdout`, `stderr`.
- `parse_run_status` (sandbox_api.py): a result with status "Error" (the service could not run the
  command) makes the answer "SandboxError"; a timeout or a nonzero return code makes it "Failed". An
  exception in the handler is also "SandboxError" (HTTP 200); one outside it is HTTP 500 (server.py).
- the runners (sandbox/runners/major.py `run_python`, base.py `run_commands`): every request runs in a
  fresh temporary directory (`files` written into it first), so nothing persists between requests; on
  "TimeLimitExceeded" the output is what could be read without blocking. `memory_limit_MB` is applied
  only under the service's `isolation: none` (its default config, sandbox/configs/local.yaml) as
  RLIMIT_AS/DATA/STACK; `isolation: lite` puts every run in a fixed 4 GB cgroup instead. There is no
  memory status (bytedance/SandboxFusion#43, open), hence `RemoteRun.memory_exceeded` below.

How verl calls it (verl/utils/reward_score/sandbox_fusion/utils.py `call_sandbox_api`, read at
volcengine/verl 10f0796d68ffa3d3b65cdc1fc55b1766d1b3af45 and verl-project/verl
b017a83320fdbc6c4e76efe499dc5f3f4aec76af): the full `/run_code` URL; the body above with
`files: {}`, `fetch_files: []`; 3 attempts retrying HTTP 504 only (linear 1 s, 2 s waits), any other error
ends at once; a POST timeout of compile + run timeout + 10 s; "SandboxError" scored as an API error,
"Failed" with "TimeLimitExceeded" as a timeout, "Finished" with a nonzero `return_code` as a runtime error.
What its users report: read timeouts under load (verl-project/verl#3478) and, from the published image,
transient "SandboxError"s when `stdin` is written to a process that already exited
(verl-project/verl#4074; the write was guarded later, SandboxFusion bb9702a).

So here: `stdin` is never sent (no write, no race); connection errors, POST timeouts and 5xx (504
included) are retried with exponential backoff (`dsv4rl.reward.http_retry`, as `reward.remote`), 4xx never;
a "SandboxError" answer is the service's failure, and since every run starts from a fresh directory it is
run again, up to `retries` times. Whatever still fails is `RemoteRun.sandbox_error`: not the model's
fault, and the caller stops the run rather than train on it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from dataclasses import dataclass
from typing import Any

import httpx

from dsv4rl.reward.http_retry import (
    BACKOFF_S,
    HTTPScorerClient,
    RewardHTTPError,
    backoff_seconds,
    json_reply,
    post_json,
)

WHAT = "sandbox service"
EXPECTED = (
    'SandboxFusion\'s RunCodeResponse ({"status": "Success" | "Failed" | "SandboxError", "message": ..., '
    '"run_result": {"status", "return_code", "stdout", "stderr", ...}})'
)
FIX = (
    "is the sandbox service up at the python tool's remote.url (SandboxFusion's /run_code endpoint) and "
    "answering within remote.timeout_s?"
)
SERVICE_MARGIN_S = 1.0  # a POST's time beyond the code's run_timeout: the service's directory, start, kill
PROBE_CODE = "print(1)"
PROBE_RUN_TIMEOUT_S = 10.0
SIGKILLED = (137, -9)  # a SIGKILL (the cgroup OOM killer): the shell's 128 + 9, or the signal itself
STATUSES = ("Success", "Failed", "SandboxError")


class SandboxServiceError(RuntimeError):
    """The sandbox service is unreachable, refuses the request or fails itself: never the code's fault."""


@dataclass
class RemoteRun:
    """What one run gave back. `memory_exceeded` is inferred, the service has no such status: the code's
    stderr ends in a `MemoryError` (the service's RLIMIT_AS) or it was SIGKILLed (return code 137 or -9:
    a cgroup's OOM killer, or a kill the code sent itself)."""

    output: str  # stdout then stderr, as the model should read them
    exit_code: int | None  # None when the code never finished
    timed_out: bool  # the service's TimeLimitExceeded
    memory_exceeded: bool
    sandbox_error: str | None  # the service failed (SandboxError, 4xx, 5xx after retries, bad JSON)
    time_s: float  # wall seconds of this run's POSTs (not the wait for a free slot)


def check_url(url: str) -> str:
    """`url` if it is an http(s) URL with a host, else ValueError naming the fix."""
    try:
        parsed = httpx.URL(url) if isinstance(url, str) else None
    except (httpx.InvalidURL, TypeError, ValueError):
        parsed = None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(
            f"remote.url={url!r} must be an http:// or https:// URL of the sandbox service's /run_code "
            "endpoint, e.g. http://sandbox-host:8080/run_code"
        )
    return url


def run_code_request(code: str, language: str, run_timeout_s: float, memory_mb: int) -> dict[str, Any]:
    """The `RunCodeRequest` body (no `stdin`: see the module docstring)."""
    return {
        "code": code,
        "language": language,
        "compile_timeout": run_timeout_s,
        "run_timeout": run_timeout_s,
        "memory_limit_MB": int(memory_mb),
        "files": {},
        "fetch_files": [],
    }


def _joined(stdout: str, stderr: str) -> str:
    if stdout and stderr and not stdout.endswith("\n"):
        stdout += "\n"
    return stdout + stderr


def read_response(data: Any, url: str, time_s: float) -> RemoteRun:
    """A `RunCodeResponse` as a `RemoteRun`; an answer of another shape is a sandbox error."""

    def failed(why: str) -> RemoteRun:
        return RemoteRun("", None, False, False, f"{WHAT} {url} {why}", time_s)

    if not isinstance(data, dict) or data.get("status") not in STATUSES:
        return failed(f"answered {str(data)[:300]!r}, not {EXPECTED}")
    if data["status"] == "SandboxError":
        return failed(f"answered SandboxError: {str(data.get('message') or '')[:500]!r} (the service failed)")
    compiled, ran = data.get("compile_result"), data.get("run_result")
    compile_failed = isinstance(compiled, dict) and (
        compiled.get("status") != "Finished" or compiled.get("return_code") != 0
    )
    result = compiled if compile_failed else ran
    if not isinstance(result, dict):
        return failed(f"answered status {data['status']!r} without a run_result: {str(data)[:300]!r}")
    status, code = result.get("status"), result.get("return_code")
    if status == "Error":
        return failed(f"could not run the code (result status Error): {str(result.get('stderr'))[:500]!r}")
    if status not in ("Finished", "TimeLimitExceeded") or (
        status == "Finished" and not isinstance(code, int)
    ):
        return failed(f"answered a result of status {status!r}, return_code {code!r}, not {EXPECTED}")
    stdout, stderr = str(result.get("stdout") or ""), str(result.get("stderr") or "")
    timed_out = status == "TimeLimitExceeded"
    exit_code = None if timed_out else code
    last = stderr.rstrip().rpartition("\n")[2]
    memory = not timed_out and (exit_code in SIGKILLED or last.startswith("MemoryError"))
    return RemoteRun(_joined(stdout, stderr), exit_code, timed_out, memory, None, time_s)


class SandboxFusionClient(HTTPScorerClient):
    """Runs code on a SandboxFusion-compatible service: at most `max_concurrency` runs in flight, each POST
    within `timeout_s`, retried `retries` times (see the module docstring). Open and close it on one event
    loop (`aclose`)."""

    def __init__(self, url: str, timeout_s: float = 60.0, retries: int = 3, max_concurrency: int = 8,
                 headers: dict[str, str] | None = None, language: str = "python", *,
                 backoff_s: float = BACKOFF_S):  # fmt: skip
        self.url = check_url(url)
        if not (isinstance(timeout_s, int | float) and timeout_s > SERVICE_MARGIN_S):
            raise ValueError(
                f"remote.timeout_s={timeout_s!r} must be a number of seconds per POST above "
                f"{SERVICE_MARGIN_S:g} (the code's own timeout plus the service's time)"
            )
        if not (isinstance(retries, int) and retries >= 0):
            raise ValueError(
                f"remote.retries={retries!r} must be an integer >= 0 (retries after the first try)"
            )
        if not (isinstance(max_concurrency, int) and max_concurrency >= 1):
            raise ValueError(
                f"remote.max_concurrency={max_concurrency!r} must be an integer >= 1 (runs in flight)"
            )
        if not (isinstance(headers, dict) or headers is None) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in (headers or {}).items()
        ):
            raise ValueError("remote.headers must map header names to string values")
        if not (isinstance(language, str) and language):
            raise ValueError(f"remote language {language!r} must be a SandboxFusion language, e.g. 'python'")
        self.timeout_s, self.retries, self.max_concurrency = float(timeout_s), retries, max_concurrency
        self.headers, self.language, self.backoff_s = dict(headers or {}), language, backoff_s
        self.limit = asyncio.Semaphore(max_concurrency)
        self._client: httpx.AsyncClient | None = None

    def client(self) -> httpx.AsyncClient:
        # A connection per run in flight: no run waits in httpx's pool, whose wait counts against timeout_s.
        if self._client is None:
            self._client = httpx.AsyncClient(limits=httpx.Limits(max_connections=self.max_concurrency))
        return self._client

    def timeout_problem(self, run_timeout_s: float) -> str | None:
        """Why a run of `run_timeout_s` cannot fit in one POST of `timeout_s`, or None (for validation)."""
        if run_timeout_s + SERVICE_MARGIN_S > self.timeout_s:
            return (
                f"remote.timeout_s={self.timeout_s:g} leaves no room for the code's timeout "
                f"{run_timeout_s:g} s plus the service's own time: make it at least "
                f"{run_timeout_s + SERVICE_MARGIN_S:g} (a POST that outlives the code's timeout is counted a "
                "service failure)"
            )
        return None

    async def run(self, code: str, run_timeout_s: float, memory_mb: int) -> RemoteRun:
        """Run `code` for at most `run_timeout_s` in `memory_mb` (-1: the service's default)."""
        problem = self.timeout_problem(run_timeout_s)
        if problem:
            raise ValueError(problem)
        body = run_code_request(code, self.language, run_timeout_s, memory_mb)
        async with self.limit:
            start = time.monotonic()
            attempts = 1 + self.retries
            for attempt in range(attempts):
                try:
                    response = await post_json(
                        self.client(),
                        self.url,
                        body,
                        what=WHAT,
                        timeout_s=self.timeout_s,
                        retries=self.retries,
                        headers=self.headers,
                        backoff_s=self.backoff_s,
                        fix=FIX,
                    )
                    data = json_reply(response, WHAT, self.url, EXPECTED)
                except RewardHTTPError as error:
                    return RemoteRun("", None, False, False, str(error), time.monotonic() - start)
                run = read_response(data, self.url, time.monotonic() - start)
                if data.get("status") != "SandboxError" or attempt + 1 == attempts:
                    break
                await asyncio.sleep(backoff_seconds(attempt, self.backoff_s))
            if run.sandbox_error and attempts > 1 and data.get("status") == "SandboxError":
                run.sandbox_error += f" (after {attempts} attempts)"
            return run

    async def probe(self, memory_mb: int = -1) -> None:
        """Run `print(1)` on the service (at validation, before the run starts); SandboxServiceError naming
        the URL and the fix unless it prints 1."""
        run_timeout_s = min(PROBE_RUN_TIMEOUT_S, self.timeout_s - SERVICE_MARGIN_S)
        run = await self.run(PROBE_CODE, run_timeout_s, memory_mb)
        if run.sandbox_error is None and run.exit_code == 0 and run.output.strip() == "1":
            return
        where = (
            f"python tool: the sandbox service at {self.url} failed a test run of {PROBE_CODE!r} "
            f"({self.language}, memory_limit_MB={memory_mb})"
        )
        if run.sandbox_error is None:  # the service runs code, but not this code
            raise SandboxServiceError(
                f"{where}: it answered exit code {run.exit_code}, timed_out={run.timed_out}, output "
                f"{run.output[:300]!r}. Fix: the python tool's memory_mb (too small for an interpreter?) or "
                "the service's Python runtime"
            )
        raise SandboxServiceError(
            f"{where}. Fix remote.url: it must be the full URL of SandboxFusion's /run_code endpoint (e.g. "
            "http://sandbox-host:8080/run_code) of a service that is up and reachable from this machine "
            "(SandboxFusion binds 127.0.0.1 by default; start it with HOST=0.0.0.0 to serve other "
            f"machines), with remote.headers if a gateway needs them. It gave: {run.sandbox_error}"
        )


def probe_service(url: str, memory_mb: int = -1, **client_kwargs: Any) -> None:
    """`SandboxFusionClient(url, **client_kwargs).probe(memory_mb)` from synchronous code (validation), in a
    thread of its own where an event loop already runs here."""

    async def go() -> None:
        client = SandboxFusionClient(url, **client_kwargs)
        try:
            await client.probe(memory_mb)
        finally:
            await client.aclose()

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(go())
        return
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, go()).result()
