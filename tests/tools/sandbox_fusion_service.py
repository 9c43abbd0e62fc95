"""A test double of SandboxFusion's `POST /run_code` (FastAPI), for the remote sandbox client's tests.

It is NOT a sandbox: the code runs as a plain `python -I` subprocess of this process, in a temporary
directory, under `run_timeout` (its process group is killed) and RLIMIT_AS of `memory_limit_MB` (as
SandboxFusion's `isolation: none` does). The request and answer use SandboxFusion's field names and
statuses (the models below mirror sandbox/server/sandbox_api.py and sandbox/runners/types.py of
bytedance/SandboxFusion; dsv4rl.tools.remote_sandbox cites the commit). Only `language: python` runs;
`files`, `fetch_files` and `compile_timeout` are accepted and ignored.

The header `X-Fault` picks a misbehaviour, counted per header value (`ServiceState.seen`) so a test can
ask for "the first n times": `http:<status>[:<n>]` answers that HTTP status (`http:503:2`: 503 twice,
then normally), `sandbox-error[:<n>]` answers status SandboxError, `not-json` a 200 with HTML,
`slow:<s>` sleeps s seconds first, `hold:<k>` waits (at most 5 s) until k requests with that header have
been in flight at once, so a concurrency bound shows in `ServiceState.max_in_flight` whatever the timing.

    python tests/tools/sandbox_fusion_service.py --port 8080   # then POST http://127.0.0.1:8080/run_code
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import signal
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Literal

import uvicorn
from fastapi import FastAPI, Header, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, Field

HOLD_LIMIT_S = 5.0


class RunCodeRequest(BaseModel):
    compile_timeout: float = 10
    run_timeout: float = 10
    memory_limit_MB: int = -1
    code: str
    stdin: str | None = None
    language: Literal["python"]  # SandboxFusion's `Language` has more; this double runs Python only
    files: dict[str, str | None] = Field(default_factory=dict)
    fetch_files: list[str] = Field(default_factory=list)


class CommandRunResult(BaseModel):
    status: Literal["Finished", "Error", "TimeLimitExceeded"]
    execution_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None


class RunCodeResponse(BaseModel):
    status: Literal["Success", "Failed", "SandboxError"]
    message: str
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    executor_pod_name: str | None = None
    files: dict[str, str] = Field(default_factory=dict)


class ServiceState:
    """What the tests read: requests seen (all POSTs, and per X-Fault value), and runs in flight and their
    peak per X-Fault value (so a request a test gave up on cannot count in the next test's peak)."""

    def __init__(self) -> None:
        self.in_flight: Counter[str] = Counter()  # live: never reset
        self.reset()

    def reset(self) -> None:
        self.requests, self.seen, self.max_in_flight = 0, Counter(), Counter()


async def run_python(request: RunCodeRequest) -> CommandRunResult:
    """The code in a `python -I` subprocess, killed with its process group at `run_timeout`."""
    limit = request.memory_limit_MB

    def set_limits() -> None:
        if limit > 0:
            _, hard = resource.getrlimit(resource.RLIMIT_AS)
            resource.setrlimit(resource.RLIMIT_AS, (limit << 20, hard))

    with tempfile.TemporaryDirectory(prefix="sandbox-fusion-double-") as tmp:
        path = os.path.join(tmp, "main.py")
        with open(path, "w") as f:
            f.write(request.code)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", path, cwd=tmp, preexec_fn=set_limits, start_new_session=True,
            stdin=asyncio.subprocess.PIPE if request.stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = bytearray(), bytearray()

        async def pump(stream: asyncio.StreamReader, into: bytearray) -> None:
            while chunk := await stream.read(1 << 16):
                into += chunk

        readers = asyncio.gather(pump(proc.stdout, out), pump(proc.stderr, err))
        if request.stdin is not None:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                proc.stdin.write(request.stdin.encode())
                await proc.stdin.drain()
            proc.stdin.close()
        start = time.monotonic()
        timed_out = False
        try:
            await asyncio.wait_for(proc.wait(), request.run_timeout)
        except TimeoutError:
            timed_out = True
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            await readers
        return CommandRunResult(
            status="TimeLimitExceeded" if timed_out else "Finished",
            execution_time=time.monotonic() - start,
            return_code=None if timed_out else proc.returncode,
            stdout=out.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
        )


def _first(fault: str, times: str | None, state: ServiceState) -> bool:
    """Whether this request is among the first `times` with this X-Fault value (always without times)."""
    return times is None or state.seen[fault] <= int(times)


def create_app(state: ServiceState) -> FastAPI:
    app = FastAPI(title="SandboxFusion /run_code test double")

    @app.middleware("http")
    async def count(request: Request, call_next):  # noqa: ANN202
        state.requests += 1
        if fault := request.headers.get("x-fault"):
            state.seen[fault] += 1
        return await call_next(request)

    @app.get("/v1/ping")
    async def ping() -> str:
        return "pong"

    @app.post("/run_code")
    async def run_code(request: RunCodeRequest, x_fault: str | None = Header(default=None)) -> Response:
        kind, _, arg = (x_fault or "").partition(":")
        if kind == "http":
            status, _, times = arg.partition(":")
            if _first(x_fault, times or None, state):
                return PlainTextResponse(f"simulated HTTP {status}", status_code=int(status))
        elif kind == "sandbox-error" and _first(x_fault, arg or None, state):
            answer = RunCodeResponse(status="SandboxError", message="simulated: the executor pod went away")
            return JSONResponse(answer.model_dump())
        elif kind == "not-json":
            return PlainTextResponse("<html>502 Bad Gateway (but 200)</html>", status_code=200)
        elif kind == "slow":
            await asyncio.sleep(float(arg))
        key = x_fault or ""
        state.in_flight[key] += 1
        state.max_in_flight[key] = max(state.max_in_flight[key], state.in_flight[key])
        try:
            if kind == "hold":
                deadline = time.monotonic() + HOLD_LIMIT_S
                while state.max_in_flight[key] < int(arg) and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
            result = await run_python(request)
        finally:
            state.in_flight[key] -= 1
        # sandbox_api.parse_run_status: a timeout or a nonzero return code is Failed
        ok = result.status == "Finished" and result.return_code == 0
        answer = RunCodeResponse(status="Success" if ok else "Failed", message="", run_result=result)
        return JSONResponse(answer.model_dump())

    return app


@contextlib.contextmanager
def serve(state: ServiceState | None = None) -> Iterator[tuple[str, ServiceState]]:
    """The service on a free loopback port, in a thread: its base URL and state."""
    state = state or ServiceState()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(create_app(state), log_level="warning", timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the SandboxFusion test double did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", state
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    args = parser.parse_args()
    uvicorn.run(create_app(ServiceState()), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
