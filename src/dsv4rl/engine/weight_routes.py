"""Weight-update endpoints of the reference engine, as SGLang 0.5.23's `srt/entrypoints/http_server.py`.

Session rules are enforced here, BEFORE the receiver is touched: an update outside a
begin/end session is refused without joining any broadcast. The session remembers what it wrote, for
`--emulate-non-idempotent-postprocess` (`Engine.close_session`); a spent engine opens no new session.
Blocking receiver calls run in a worker thread; updates hold the model (no forward in flight) and, when not
paused, wait for in-flight requests first, like SGLang's writer lock. A router the server includes; each
handler works on the app's `Engine`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from dsv4rl.engine.http_util import Body, read_body
from dsv4rl.engine.state import Engine
from dsv4rl.engine.tensor_update import RELEASED, SUCCESS, receive_tensors
from dsv4rl.faults import heartbeat
from dsv4rl.wire.checksum import checksums, engine_checksum, overall_checksum
from dsv4rl.wire.layout import dtype_name

__all__ = ["router"]

log = logging.getLogger("dsv4rl.engine")
router = APIRouter()

OUTSIDE_SESSION = "{endpoint} must run between begin_weight_update() and end_weight_update()"  # SGLang's text
NOT_FLUSHED = (
    "Weights were updated, but the cache was not flushed because requests are still running or queued. "
    "Retract or finish them, then call /flush_cache."
)


class SelectorBody(Body):
    selector: str = "all"


class InitGroupBody(Body):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class DistributedBody(Body):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    selector: str = "all"
    torch_empty_cache: bool = False


class TensorBody(Body):
    serialized_named_tensors: list[str]  # base64 over HTTP (SGLang: Annotated[List[bytes], Base64Bytes()])
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class DiskBody(Body):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True


class GroupBody(Body):
    group_name: str = "weight_update_group"


class VersionBody(Body):
    new_version: str
    abort_all_requests: bool = True


class CheckerBody(Body):
    action: str = "checksum"
    allow_quant_error: bool = False  # the held tensors are compared exactly, so there is no quant error
    skip_tensor_list: list[str] | None = None  # substrings, as in SGLang
    selector: str = "all"


# One TP rank, no DP/PP: the shape SGLang gives every rank's entry.
PARALLELISM_INFO = [
    {"role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "pp_rank": 0, "pp_size": 1,
     "rank": 0, "size": 1}
]  # fmt: skip


def result(success: bool, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse(
        {"success": success, "message": message, **extra}, status_code=200 if success else 400
    )


def _receiver_or_error(engine: Engine) -> tuple[Any, JSONResponse | None]:
    try:
        return engine.get_receiver(), None
    except ImportError as error:
        return None, result(False, f"The weight receiver is not available: {error}")


@router.post("/begin_weight_update")
async def begin_weight_update(request: Request) -> JSONResponse:
    engine: Engine = request.app.state.engine
    generator = engine.generator
    await read_body(request, SelectorBody)

    def run() -> bool:
        with generator.exclusive():
            if engine.session_open or engine.spent:
                return False
            engine.open_session()
            return True

    if not await asyncio.to_thread(run):
        if engine.spent:
            return result(False, f"the engine's weights are spent: {engine.spent}")
        return result(False, "a weight-update session is already open; call end_weight_update() first")
    return result(True, "Success")


@router.post("/end_weight_update")
async def end_weight_update(request: Request) -> JSONResponse:
    engine: Engine = request.app.state.engine
    generator = engine.generator
    await read_body(request, SelectorBody)

    def run() -> bool:
        with generator.exclusive():
            was_open = engine.session_open
            if was_open:
                engine.close_session()  # SGLang's post-processing of every module
            return was_open

    if not await asyncio.to_thread(run):
        return result(False, "no weight-update session is open; call begin_weight_update() first")
    return result(True, "Success")


@router.post("/init_weights_update_group")
async def init_weights_update_group(request: Request) -> JSONResponse:
    engine: Engine = request.app.state.engine
    body = await read_body(request, InitGroupBody)
    receiver, error = _receiver_or_error(engine)
    if error is not None:
        return error
    rank = body.rank_offset  # + tp_rank, which is 0 here
    log.info(
        "init custom process group: master_address=%s, master_port=%d, rank=%d, world_size=%d, "
        "group_name=%s, backend=%s",
        body.master_address, body.master_port, rank, body.world_size, body.group_name, body.backend,
    )  # fmt: skip
    try:
        await asyncio.to_thread(
            receiver.init_group,
            body.master_address, body.master_port, body.rank_offset, body.world_size,
            body.group_name, body.backend,
        )  # fmt: skip
    except Exception as exc:
        log.exception("init_weights_update_group failed")
        return result(False, f"Failed to initialize custom process group: {exc}.")
    return result(True, "Succeeded to initialize custom process group.")


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(request: Request) -> JSONResponse:
    engine: Engine = request.app.state.engine
    generator = engine.generator
    body = await read_body(request, DistributedBody)
    if not engine.session_open:
        return result(False, OUTSIDE_SESSION.format(endpoint="update_weights_from_distributed"))
    if engine.weights.released:  # refused before any broadcast is joined
        return result(False, RELEASED)
    if not len(body.names) == len(body.dtypes) == len(body.shapes):
        return result(
            False,
            f"names ({len(body.names)}), dtypes ({len(body.dtypes)}) and shapes ({len(body.shapes)}) "
            "must have the same length",
        )
    receiver, error = _receiver_or_error(engine)
    if error is not None:
        return error
    if body.abort_all_requests:
        generator.abort(abort_all=True)

    def run() -> bool:
        with generator.exclusive(), heartbeat.busy("weight_update", engine.session_step):
            receiver.receive(body.names, body.dtypes, body.shapes, body.group_name, body.load_format)
            engine.session_sent.update(body.names)
            if body.flush_cache and generator.busy():
                return False
            if body.weight_version is not None:
                generator.weight_version = body.weight_version
            return True

    try:
        flushed = await asyncio.to_thread(run)
    except Exception as exc:
        log.exception("update_weights_from_distributed failed")
        message = str(exc)
        if not message.startswith("Failed"):
            message = f"Failed to update weights: {message}"
        engine.update_failed(message)
        return result(False, message)
    if not flushed:
        return result(False, NOT_FLUSHED)
    message = "Succeeded to update parameter online."
    if body.weight_version is not None:
        message += f" Weight version updated to {body.weight_version}."
    return result(True, message)


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(request: Request) -> JSONResponse:
    """Tensors a colocated trainer shared by handle (`dsv4rl.engine.tensor_update`)."""
    engine: Engine = request.app.state.engine
    generator = engine.generator
    body = await read_body(request, TensorBody)
    if not engine.session_open:
        return result(False, OUTSIDE_SESSION.format(endpoint="update_weights_from_tensor"))
    if body.abort_all_requests:
        generator.abort(abort_all=True)

    def run() -> bool:
        received = receive_tensors(
            engine.weights, body.serialized_named_tensors, body.load_format, engine.args.tp_size
        )
        with generator.exclusive(), heartbeat.busy("weight_update", engine.session_step):
            engine.weights.commit(received)
            engine.session_sent.update(received)
            if body.flush_cache and generator.busy():
                return False
            if body.weight_version is not None:
                generator.weight_version = body.weight_version
            return True

    try:
        flushed = await asyncio.to_thread(run)
    except Exception as exc:
        log.warning("update_weights_from_tensor refused: %s", exc)
        engine.update_failed(str(exc))
        return result(False, f"Failed to update weights from tensor: {exc}")
    if not flushed:
        return result(False, NOT_FLUSHED)
    message = SUCCESS
    if body.weight_version is not None:
        message += f" Weight version updated to {body.weight_version}."
    return result(True, message)


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request) -> JSONResponse:
    engine: Engine = request.app.state.engine
    generator = engine.generator
    body = await read_body(request, DiskBody)
    if body.abort_all_requests:
        generator.abort(abort_all=True)

    def run() -> None:
        from dsv4rl.model.native_checkpoint import load_native_checkpoint

        _, stored = load_native_checkpoint(body.model_path, engine.model.dtype)
        held = engine.weights
        names = sorted(held.state())
        missing = sorted(set(names) - stored.keys())
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} tensors the engine holds: {missing[:5]}")
        tensors = {name: stored[name] for name in names}
        held.plan(
            names,
            [dtype_name(t.dtype) for t in tensors.values()],
            [list(t.shape) for t in tensors.values()],
        )
        with generator.exclusive():
            held.commit(tensors)
            if body.weight_version is not None:
                generator.weight_version = body.weight_version

    try:
        await asyncio.to_thread(run)
    except Exception as exc:
        return result(False, f"Failed to update weights from disk: {exc}", num_paused_requests=0)
    return result(True, "Succeeded to update model weights.", num_paused_requests=0)


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(request: Request) -> JSONResponse:
    engine: Engine = request.app.state.engine
    body = await read_body(request, GroupBody)
    receiver, error = _receiver_or_error(engine)
    if error is not None:
        return error
    if not receiver.has_group(body.group_name):
        return result(False, "The group to be destroyed does not exist.")
    try:
        await asyncio.to_thread(receiver.destroy_group, body.group_name)
    except Exception as exc:
        return result(False, f"Failed to destroy custom process group: {exc}.")
    return result(True, "Succeeded to destroy custom process group.")


@router.post("/update_weight_version")
async def update_weight_version(request: Request) -> JSONResponse:
    engine: Engine = request.app.state.engine
    generator = engine.generator
    body = await read_body(request, VersionBody)
    if body.abort_all_requests:
        generator.abort(abort_all=True)
    await asyncio.to_thread(generator.set_weight_version, body.new_version)
    return JSONResponse(
        {
            "success": True,
            "message": f"Weight version updated to {body.new_version}",
            "new_version": body.new_version,
        }
    )


@router.api_route("/weights_checker", methods=["GET", "POST"])
async def weights_checker(request: Request) -> JSONResponse:
    """SGLang's four actions over the held tensors (native names, held dtypes; sha256 per tensor)."""
    engine: Engine = request.app.state.engine
    generator = engine.generator
    body = await read_body(request, CheckerBody)
    skip = list(body.skip_tensor_list or [])
    held = engine.weights
    if held.released:
        return result(False, RELEASED)

    def kept() -> dict[str, Any]:
        return {n: t for n, t in held.state().items() if not any(pattern in n for pattern in skip)}

    def run() -> JSONResponse:
        with generator.model_lock, held.lock:
            if body.action == "checksum":
                sums = checksums(kept())
                per_gpu = overall_checksum(sums)
                rank = {
                    "checksums": sums,
                    "per_gpu_checksum": per_gpu,
                    "parallelism_info": PARALLELISM_INFO,
                }
                engine_sum = engine_checksum([per_gpu])
                return JSONResponse(
                    {"success": True, "message": "", "ranks": [rank], "per_engine_checksum": engine_sum}
                )
            if body.action == "snapshot":
                engine.checksum_snapshot = {n: t.clone() for n, t in held.state().items()}
                return result(True, "")
            if body.action == "compare":
                if engine.checksum_snapshot is None:
                    return result(False, "No snapshot: call weights_checker with action snapshot first.")
                snapshot, engine.checksum_snapshot = engine.checksum_snapshot, None
                changed = sorted(
                    n
                    for n, t in kept().items()
                    if not torch.equal(
                        snapshot[n].view(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)
                    )
                )
                if changed:
                    return result(False, f"{len(changed)} tensors differ from the snapshot: {changed[:10]}")
                return result(True, "")
        if body.action == "reset_tensors":
            with generator.exclusive():
                held.reset_random(skip)
            return result(True, "")
        return result(False, f"Unsupported action={body.action!r}")

    return await asyncio.to_thread(run)


@router.api_route("/get_weights_by_name", methods=["GET", "POST"])
async def get_weights_by_name() -> JSONResponse:
    return JSONResponse({"error": {"message": "Get parameter by name failed"}}, status_code=400)
