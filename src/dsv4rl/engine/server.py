"""The reference engine's HTTP server: SGLang 0.5.23's protocol on FastAPI.

`create_app(model_path, ...)` loads the model and tokenizer and returns the app; `main(argv)` serves it
with uvicorn. The generation and control endpoints live here; the weight-update endpoints
(`dsv4rl.engine.weight_routes`), the memory endpoints (`dsv4rl.engine.memory_routes`) and the chat
completions a judge asks (`dsv4rl.engine.chat_routes`) are routers the app includes. Every handler works
on the app's `Engine` (`dsv4rl.engine.state`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from dsv4rl.engine.args import ServerArgs, parse_args
from dsv4rl.engine.chat_routes import router as chat_router
from dsv4rl.engine.generator import GenRequest
from dsv4rl.engine.http_util import AbortBody, BadRequest, PauseBody, check_auth, read_body
from dsv4rl.engine.memory_routes import router as memory_router
from dsv4rl.engine.protocol import ContractError, RangeError, build_response, parse_generate
from dsv4rl.engine.state import Engine
from dsv4rl.engine.weight_routes import router as weight_router


def create_app(model_path: str, *, receiver: Any = None, **kwargs: Any) -> FastAPI:
    """The FastAPI app over the model at `model_path`; kwargs are ServerArgs fields."""
    engine = Engine(ServerArgs(model_path=model_path, **kwargs), receiver=receiver)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        threading.Thread(target=engine.warmup, name="dsv4rl-warmup", daemon=True).start()
        yield
        engine.shutting_down = True
        engine.generator.close()

    app = FastAPI(title="dsv4rl reference engine", lifespan=lifespan)
    app.state.engine = engine

    @app.middleware("http")
    async def auth(request: Request, call_next: Any) -> Response:
        status = check_auth(
            request.url.path,
            request.headers.get("authorization"),
            engine.args.api_key,
            engine.args.admin_api_key,
            request.method,
        )
        if status is not None:
            return JSONResponse({"error": "Unauthorized"}, status_code=status)
        return await call_next(request)

    @app.exception_handler(BadRequest)
    async def bad_request(_: Request, error: BadRequest) -> JSONResponse:
        body = {"object": "error", "message": str(error), "type": "Bad Request", "param": None, "code": 400}
        return JSONResponse(body, status_code=400)

    @app.exception_handler(ContractError)
    async def contract_error(_: Request, error: ContractError) -> JSONResponse:
        return JSONResponse({"error": str(error)}, status_code=400)

    @app.exception_handler(RangeError)
    async def range_error(_: Request, error: RangeError) -> JSONResponse:
        return JSONResponse({"error": {"message": str(error)}}, status_code=400)

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        if engine.status == "Starting" or engine.shutting_down:
            return Response(status_code=503)
        if os.environ.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "1") == "0":
            return Response(status_code=200)
        if engine.refusal():  # released memory (SGLang's would crash) or spent weights: nothing may run
            return Response(status_code=503)
        return Response(status_code=200 if await engine.health_generate() else 503)

    @app.get("/ready")
    async def ready() -> Response:
        up = engine.status == "Up" and not engine.generator.paused and not engine.shutting_down
        return Response(status_code=200 if up else 503)

    @app.get("/ping")
    async def ping() -> Response:
        return Response(status_code=200 if engine.status == "Up" and not engine.shutting_down else 503)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict:
        return engine.model_info()

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict:
        return engine.server_info()

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError as error:
            raise ContractError(f"invalid JSON body: {error}") from error
        call = parse_generate(
            body,
            encode=engine.encode if engine.tokenizer is not None else None,
            vocab_size=engine.generator.vocab_size,
            context_length=engine.context_length,
        )
        loop = asyncio.get_running_loop()
        changed = asyncio.Event()

        def wake() -> None:
            loop.call_soon_threadsafe(changed.set)

        # A stream answers every change; a plain call wakes once, when its last sequence ends (a batch of
        # 512 sequences used to wake this loop 512 times, each wake checking all 512).
        last_one = None if call.stream else LastToFinish(len(call.requests), wake)
        for item in call.requests:
            item.listeners.append(wake if last_one is None else partial(last_one.changed, item))
        try:
            engine.generator.submit(call.requests)
        except ValueError as error:
            raise RangeError(str(error)) from error
        decode = engine.decode if engine.tokenizer is not None else None

        def respond(item: GenRequest, final: bool = True) -> dict:
            return build_response(
                item,
                current_version=engine.generator.weight_version,
                decode=decode,
                final=final,
                return_prompt_token_ids=call.return_prompt_token_ids,
                capture=engine.generator.capture,
            )

        if call.stream:
            return StreamingResponse(
                _stream(engine, call.requests, changed, respond, call.batched), media_type="text/event-stream"
            )
        try:
            while True:
                changed.clear()
                if all(item.finished for item in call.requests):
                    break
                await changed.wait()
        finally:
            _abort_unfinished(engine, call.requests)
        for item in call.requests:
            status = (item.finish_reason or {}).get("status_code")
            if status and status >= 400:
                return JSONResponse({"error": {"message": item.finish_reason["message"]}}, status_code=status)
        answers = [respond(item) for item in call.requests]
        # orjson: a many-sequence answer renders several times faster than through JSONResponse
        return Response(orjson.dumps(answers if call.batched else answers[0]), media_type="application/json")

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> dict:
        body = await read_body(request, PauseBody)
        await asyncio.to_thread(engine.generator.pause, body.mode)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation() -> dict:
        engine.generator.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await read_body(request, AbortBody)
        engine.generator.abort(body.rid, body.abort_all)
        return Response(status_code=200)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(timeout: float = 0.0) -> PlainTextResponse:
        if timeout > 0 and not await asyncio.to_thread(engine.generator.wait_idle, timeout):
            return PlainTextResponse("Timed out waiting for idle state.", status_code=400)
        if engine.generator.busy():
            return PlainTextResponse("Flush cache failed.", status_code=400)
        return PlainTextResponse(
            "Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)\n"
        )

    @app.api_route("/freeze_gc", methods=["GET", "POST"])
    async def freeze_gc() -> Response:
        engine.freeze_gc()
        return Response(content="Garbage collection frozen.\n", status_code=200)

    app.include_router(memory_router)
    app.include_router(weight_router)
    app.include_router(chat_router)  # /v1/chat/completions: a judge on CPU
    return app


class LastToFinish:
    """Calls `wake` once `count` distinct requests have finished; listeners run on the generator thread."""

    def __init__(self, count: int, wake: Callable[[], None]) -> None:
        self.count, self.wake = count, wake
        self.finished: set[int] = set()
        self.lock = threading.Lock()

    def changed(self, request: GenRequest) -> None:
        if not request.finished:
            return
        with self.lock:
            first_time = id(request) not in self.finished
            self.finished.add(id(request))
            done = first_time and len(self.finished) == self.count
        if done:
            self.wake()


def _abort_unfinished(engine: Engine, requests: list[GenRequest]) -> None:
    """A caller that went away (disconnect, cancel) must not leave its sequences running."""
    for item in requests:
        if not item.finished:
            engine.generator.abort(item.rid)


async def _stream(
    engine: Engine, requests: list[GenRequest], changed: asyncio.Event, respond: Any, batched: bool
) -> AsyncIterator[str]:
    """SSE with cumulative chunks (SGLang's default), then `data: [DONE]`."""
    seen: dict[int, tuple[int, bool]] = {}
    try:
        while True:
            changed.clear()
            for index, item in enumerate(requests):
                state = (len(item.output_ids), item.finished)
                if seen.get(index) == state or (state == (0, False)):
                    continue
                seen[index] = state
                chunk = respond(item, final=item.finished)
                if batched:
                    chunk["index"] = index
                yield f"data: {json.dumps(chunk)}\n\n"
            if all(item.finished for item in requests):
                break
            await changed.wait()
        yield "data: [DONE]\n\n"
    finally:
        _abort_unfinished(engine, requests)


def main(argv: list[str] | None = None) -> None:
    """Parse SGLang-style flags and serve until interrupted."""
    import uvicorn

    args = parse_args(argv)
    logging.basicConfig(
        level=args.pop("log_level").upper(), format="[%(asctime)s] %(name)s %(levelname)s: %(message)s"
    )
    level = logging.getLogger().level
    app = create_app(args.pop("model_path"), log_level=logging.getLevelName(level).lower(), **args)
    engine: Engine = app.state.engine
    # A bounded graceful shutdown: held /generate calls (paused server) would otherwise keep it alive.
    uvicorn.run(
        app,
        host=engine.args.host,
        port=engine.args.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,
    )
