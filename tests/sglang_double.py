"""An in-process SGLang test double: the response and error shapes of SGLang 0.5.23's HTTP server."""

from __future__ import annotations

import asyncio
from collections import Counter, defaultdict

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from dsv4rl.engine_client.client import EngineClient

SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop", "stop_token_ids"}
ADMIN_PATHS = {
    "/pause_generation",
    "/continue_generation",
    "/flush_cache",
    "/abort_request",
    "/begin_weight_update",
    "/end_weight_update",
    "/init_weights_update_group",
    "/update_weights_from_distributed",
    "/destroy_weights_update_group",
    "/update_weight_version",
}


def make_app(api_key: str | None = None, admin_api_key: str | None = None, delay_s: float = 0.0) -> FastAPI:
    app = FastAPI()
    st = app.state
    st.calls = Counter()
    st.fail = defaultdict(list)  # endpoint -> statuses to answer before behaving
    st.starting = 0  # /health_generate answers 503 this many times
    st.delay_s = delay_s
    st.in_flight = 0
    st.max_in_flight = 0
    st.session = False
    st.busy = False
    st.version = "default"
    st.groups = set()
    st.headers = []

    @app.middleware("http")
    async def auth_and_faults(request: Request, call_next):
        path = request.url.path
        st.calls[path] += 1
        st.headers.append(request.headers.get("authorization"))
        if not path.startswith("/health"):
            needed = (admin_api_key or api_key) if path in ADMIN_PATHS else api_key
            if needed and request.headers.get("authorization") != f"Bearer {needed}":
                return JSONResponse({"error": "Unauthorized"}, status_code=401)
        if st.fail[path]:
            return PlainTextResponse("upstream unavailable", status_code=st.fail[path].pop(0))
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError):
        body = {
            "object": "error",
            "message": str(exc.errors()),
            "type": "Bad Request",
            "param": None,
            "code": 400,
        }
        return JSONResponse(body, status_code=400)

    @app.get("/health_generate")
    async def health_generate():
        if st.starting > 0:
            st.starting -= 1
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/model_info")
    async def model_info():
        return {"model_path": "/m", "is_generation": True, "weight_version": st.version}

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        params = body.get("sampling_params", {})
        unknown = set(params) - SAMPLING_KEYS
        if unknown:
            key = sorted(unknown)[0]
            return JSONResponse({"error": f"unknown field `{key}`, expected one of ..."}, status_code=400)
        if params.get("max_new_tokens", 128) < 0:
            return JSONResponse({"error": {"message": "max_new_tokens must be at least 0"}}, status_code=400)
        st.in_flight += 1
        st.max_in_flight = max(st.max_in_flight, st.in_flight)
        try:
            await asyncio.sleep(st.delay_s)
        finally:
            st.in_flight -= 1
        ids = body["input_ids"]
        batch = ids if isinstance(ids[0], list) else [ids]
        n = params.get("n", 1)
        outs = []
        for prompt in batch:
            for s in range(n):
                out = [(sum(prompt) + s + i) % 50 for i in range(params.get("max_new_tokens", 4))]
                meta = {
                    "id": body.get("rid") or "x",
                    "finish_reason": {"type": "length", "length": len(out)},
                    "prompt_tokens": len(prompt),
                    "completion_tokens": len(out),
                    "weight_version": st.version,
                }
                if body.get("return_logprob"):
                    meta["output_token_logprobs"] = [[-0.5, t, None] for t in out]
                outs.append({"text": "", "output_ids": out, "meta_info": meta})
        return outs[0] if not isinstance(ids[0], list) and n == 1 else outs

    @app.post("/pause_generation")
    async def pause(request: Request):
        await request.json()
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def cont():
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/flush_cache")
    async def flush():
        if st.busy:
            return PlainTextResponse("Flush cache failed.", status_code=400)
        return PlainTextResponse("Cache flushed.\n")

    @app.post("/begin_weight_update")
    async def begin():
        if st.session:
            return JSONResponse(
                {"success": False, "message": "a weight-update session is already open"}, status_code=400
            )
        st.session = True
        return {"success": True, "message": "ok"}

    @app.post("/end_weight_update")
    async def end():
        if not st.session:
            return JSONResponse({"success": False, "message": "no weight-update session"}, status_code=400)
        st.session = False
        return {"success": True, "message": "ok"}

    @app.post("/init_weights_update_group")
    async def init_group(request: Request):
        body = await request.json()
        st.groups.add(body["group_name"])
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    @app.post("/update_weights_from_distributed")
    async def update(request: Request):
        body = await request.json()
        if not st.session:
            msg = "must run between begin_weight_update() and end_weight_update()"
            return JSONResponse({"success": False, "message": msg}, status_code=400)
        if body.get("weight_version"):
            st.version = body["weight_version"]
        return {"success": True, "message": "Succeeded to update parameter online."}

    @app.post("/destroy_weights_update_group")
    async def destroy(request: Request):
        body = await request.json()
        if body["group_name"] not in st.groups:
            return JSONResponse(
                {"success": False, "message": "The group to be destroyed does not exist."}, status_code=400
            )
        st.groups.discard(body["group_name"])
        return {"success": True, "message": "ok"}

    @app.post("/update_weight_version")
    async def version(request: Request):
        body = await request.json()
        st.version = body["new_version"]
        return {
            "success": True,
            "message": f"Weight version updated to {st.version}",
            "new_version": st.version,
        }

    @app.post("/weights_say_no")
    async def say_no():  # success:false with HTTP 200 (per-DP messages joined)
        return {"success": False, "message": "rank 0: bad | rank 1: bad"}

    return app


URL = "http://engine-a:30000"


@pytest.fixture
def app() -> FastAPI:
    return make_app()


@pytest.fixture
def new_app():
    """Factory for extra test doubles (auth keys, delays)."""
    return make_app


@pytest.fixture
def client_for():
    """EngineClient(url) talking to an app in-process; fast backoff so retry tests take milliseconds."""

    def build(app: FastAPI, url: str = URL, **kwargs) -> EngineClient:
        kwargs.setdefault("backoff_s", 0.01)
        return EngineClient(url, transport=httpx.ASGITransport(app=app), **kwargs)

    return build
