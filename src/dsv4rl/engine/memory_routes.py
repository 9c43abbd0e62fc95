"""`/release_memory_occupation` and `/resume_memory_occupation` of the reference engine.

As SGLang 0.5.23's `srt/entrypoints/http_server.py`: GET or POST, body `{"tags": [...] | null}`
(ReleaseMemoryOccupationReqInput / ResumeMemoryOccupationReqInput in `srt/managers/io_struct.py`),
JSON null on success, an error as 400 `{"error": {"message"}}`. The rules are `dsv4rl.engine.memory`'s.
A router the server includes; each handler works on the app's `Engine`.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from dsv4rl.engine.http_util import Body, read_body
from dsv4rl.engine.memory import MemoryRefused
from dsv4rl.engine.state import Engine

__all__ = ["router"]

log = logging.getLogger("dsv4rl.engine")
router = APIRouter()


class TagsBody(Body):
    tags: list[str] | None = None


def _refused(error: MemoryRefused) -> JSONResponse:
    return JSONResponse({"error": {"message": str(error)}}, status_code=400)


@router.api_route("/release_memory_occupation", methods=["GET", "POST"])
async def release_memory_occupation(request: Request) -> JSONResponse:
    engine: Engine = request.app.state.engine
    body = await read_body(request, TagsBody)
    try:
        tags = await asyncio.to_thread(engine.memory.release, body.tags)
    except MemoryRefused as error:
        return _refused(error)
    log.info("memory released: %s", ", ".join(tags))
    return JSONResponse(None)


@router.api_route("/resume_memory_occupation", methods=["GET", "POST"])
async def resume_memory_occupation(request: Request) -> JSONResponse:
    engine: Engine = request.app.state.engine
    body = await read_body(request, TagsBody)
    try:
        tags = await asyncio.to_thread(engine.memory.resume, body.tags)
    except MemoryRefused as error:
        return _refused(error)
    log.info("memory resumed: %s", ", ".join(tags))
    return JSONResponse(None)
