"""Async HTTP client for SGLang's server protocol (and dsv4rl's reference engine, which speaks the same).

One `EngineClient` per engine. It bounds in-flight `/generate` calls, retries only what is safe to
repeat (a broken or refused connection and 502/503/504 on `/generate` and GETs, with backoff, on a fresh
connection; never a weight-update, pause or session POST, whose side effects may already have happened),
and turns every failure into an `EngineError` that names the engine, the endpoint and the server's own
message.

httpx clients and asyncio semaphores belong to one event loop; the client keeps one of each per loop,
so the same `EngineClient` works from `asyncio.run` calls in several threads (the weight sync POSTs
from a helper thread while the trainer joins the broadcast).
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import json
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from dsv4rl.config.choices import choice
from dsv4rl.config.sglang_choices import PauseMode
from dsv4rl.faults import heartbeat

RETRY_STATUSES = frozenset({502, 503, 504})
# A connection that broke under a request (reset, closed, a read or write that failed) or that could not
# be had (connect, pool): on an idempotent call these are retried on a fresh connection. A read timeout is
# not among them: the request may still be running on the engine, and the hang watchdog names that case.
TRANSIENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.RemoteProtocolError,
             httpx.ReadError, httpx.WriteError)  # fmt: skip
# Idle connections are dropped by the client before the server would close them (uvicorn's and SGLang's
# keep-alive is 5 s, `SGLANG_TIMEOUT_KEEP_ALIVE`): at equal timers a request sent on a connection the
# server is closing at that moment fails with a read error (the keep-alive race).
KEEPALIVE_EXPIRY_S = 2.0
_MAX_MESSAGE_CHARS = 600


class EngineError(RuntimeError):
    """A request to one engine failed; `str(err)` names the engine, the endpoint and the server's message."""

    def __init__(self, engine: str, endpoint: str, message: str, status: int | None = None):
        self.engine = engine
        self.endpoint = endpoint
        self.status = status
        self.server_message = message
        where = f"engine {engine} {endpoint}"
        super().__init__(
            f"{where}: HTTP {status}: {message}" if status is not None else f"{where}: {message}"
        )


def server_message(response: httpx.Response) -> str:
    """The human part of an SGLang error body, whichever of its shapes the server used."""
    text = response.text.strip()
    try:
        body = json.loads(text) if text else None
    except ValueError:
        body = None
    message: Any = None
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, str):
            message = error  # /generate contract violation, auth rejections
        elif isinstance(error, dict):
            message = error.get("message") or json.dumps(error)  # handler ValueError, SSE errors
        elif "message" in body:
            message = body["message"]  # weight endpoints {"success", "message"}; OpenAI-style object
        elif "detail" in body:
            message = body["detail"]  # FastAPI's own validation errors
    if message is None:
        message = text or response.reason_phrase or "(empty body)"
    if not isinstance(message, str):
        message = json.dumps(message)
    return message if len(message) <= _MAX_MESSAGE_CHARS else message[:_MAX_MESSAGE_CHARS] + "..."


@dataclass
class _LoopState:
    http: httpx.AsyncClient
    semaphore: asyncio.Semaphore


class EngineClient:
    """One engine. `timeout_s` bounds each attempt of a request (waiting for a concurrency slot excluded)."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 600.0,
        retries: int = 2,
        max_concurrency: int = 64,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        backoff_s: float = 0.5,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        self.max_concurrency = max_concurrency
        self.backoff_s = backoff_s
        self._api_key = api_key
        self._admin_api_key = admin_api_key or api_key
        self._transport = transport
        self._states: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopState] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()
        self.in_flight = 0  # /generate calls accepted by this client and not yet answered (incl. queued)

    def __repr__(self) -> str:
        return f"EngineClient({self.base_url!r})"

    def move_to(self, base_url: str) -> None:
        """The engine listens at `base_url` now (restarted on another port): every later request goes
        there; the connections to its old address are dead with its old process."""
        with self._lock:
            self.base_url = base_url.rstrip("/")
            for state in self._states.values():
                state.http.base_url = self.base_url

    # ----------------------------------------------------------------------------------- plumbing
    def _state(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        with self._lock:
            state = self._states.get(loop)
            if state is None:
                http = httpx.AsyncClient(
                    base_url=self.base_url,
                    timeout=httpx.Timeout(self.timeout_s, connect=min(self.timeout_s, 10.0)),
                    transport=self._transport,
                    limits=httpx.Limits(
                        max_connections=None,
                        max_keepalive_connections=self.max_concurrency,
                        keepalive_expiry=KEEPALIVE_EXPIRY_S,
                    ),
                )
                state = _LoopState(http, asyncio.Semaphore(self.max_concurrency))
                self._states[loop] = state
        return state

    def _headers(self, admin: bool) -> dict[str, str]:
        key = self._admin_api_key if admin else self._api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def _request(
        self,
        method: str,
        endpoint: str,
        *,
        body: Any = None,
        params: dict[str, Any] | None = None,
        retry: bool,
        admin: bool = False,
        timeout_s: float | None = None,
    ) -> httpx.Response:
        """One call with retries where `retry`; any non-2xx answer raises EngineError."""
        http = self._state().http
        timeout = self.timeout_s if timeout_s is None else timeout_s
        headers = self._headers(admin)
        content = None
        if body is not None:  # orjson: a many-sample /generate body costs a fraction of json's time
            content = orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS)
            headers["Content-Type"] = "application/json"
        attempts = 1 + (self.retries if retry else 0)
        for attempt in range(attempts):
            last = attempt == attempts - 1
            try:
                async with asyncio.timeout(timeout):
                    response = await http.request(
                        method,
                        endpoint,
                        content=content,
                        params=params,
                        headers=headers,
                        timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
                    )
            except TRANSIENT as exc:
                # Nothing was sent (connect, pool) or the connection broke under the request (the
                # keep-alive race, a reset): an idempotent call is sent again on a fresh connection (httpx
                # drops the broken one); non-retryable calls get the error at once.
                if last:
                    nothing_sent = isinstance(
                        exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout
                    )
                    what = "cannot connect" if nothing_sent else "connection lost"
                    tried = f" (after {attempts} attempts)" if attempts > 1 else ""
                    raise EngineError(self.base_url, endpoint, f"{what}{tried}: {exc!r}") from exc
            except (TimeoutError, httpx.TimeoutException) as exc:
                # A request that timed out may still be running on the server: never repeat it.
                raise EngineError(self.base_url, endpoint, f"timed out after {timeout:g} s") from exc
            except httpx.HTTPError as exc:
                raise EngineError(self.base_url, endpoint, f"request failed: {exc!r}") from exc
            else:
                if response.status_code < 400:
                    heartbeat.progress()  # the hang watchdog: a long rollout that gets answers is moving
                    return response
                if last or response.status_code not in RETRY_STATUSES:
                    raise EngineError(self.base_url, endpoint, server_message(response), response.status_code)
            await asyncio.sleep(self.backoff_s * (2**attempt))
        raise AssertionError("unreachable")

    async def _get_json(self, endpoint: str) -> Any:
        return _json(await self._request("GET", endpoint, retry=True), self.base_url, endpoint)

    async def _control(self, endpoint: str, body: dict[str, Any] | None = None, *, admin: bool = True) -> Any:
        """A POST with side effects: sent once, never retried."""
        response = await self._request("POST", endpoint, body=body or {}, retry=False, admin=admin)
        text = response.text.strip()
        if not text:
            return None
        try:
            return response.json()
        except ValueError:
            return text

    async def _weights(self, endpoint: str, body: dict[str, Any]) -> dict:
        """Weight endpoints answer {"success", "message"}; success false is an error even with HTTP 200."""
        result = await self._control(endpoint, body)
        if isinstance(result, dict) and result.get("success") is False:
            raise EngineError(self.base_url, endpoint, str(result.get("message", result)), 200)
        return result if isinstance(result, dict) else {"success": True, "message": result}

    # ----------------------------------------------------------------------------------- health / info
    async def health(self, timeout_s: float = 30.0) -> bool:
        """GET /health_generate (a real 1-token generation on SGLang): True on 200."""
        try:
            await self._request("GET", "/health_generate", retry=False, timeout_s=timeout_s)
        except EngineError:
            return False
        return True

    async def wait_healthy(
        self,
        timeout_s: float,
        should_abort: Callable[[], bool] | None = None,
        *,
        min_interval_s: float = 0.5,
        max_interval_s: float = 2.0,
        answered_elsewhere: Callable[[], bool] | None = None,
    ) -> None:
        """Poll /health_generate until 200; raise EngineError on timeout or when `should_abort()` is true.
        `answered_elsewhere()` true ends the wait without another probe: a probe is a real generation on
        SGLang, and one that lands between a rollout and a colocated memory release fails the release."""
        start = time.monotonic()
        interval = min_interval_s
        last = "no answer yet"
        while True:
            if answered_elsewhere is not None and answered_elsewhere():
                return
            waited = time.monotonic() - start
            if should_abort is not None and should_abort():
                raise EngineError(
                    self.base_url,
                    "/health_generate",
                    f"engine process exited while waiting for it to become healthy ({waited:.1f} s); "
                    f"last probe: {last}",
                )
            remaining = timeout_s - waited
            if remaining <= 0:
                raise EngineError(
                    self.base_url,
                    "/health_generate",
                    f"not healthy after waiting {waited:.1f} s (timeout {timeout_s:g} s); "
                    f"last probe: {last}. "
                    "Raise engine.startup_timeout_s if the model is still loading, or read the engine's log.",
                )
            try:
                await self._request(
                    "GET", "/health_generate", retry=False, timeout_s=max(0.1, min(remaining, 30.0))
                )
                return
            except EngineError as err:
                last = f"HTTP {err.status}: {err.server_message}" if err.status else err.server_message
            await asyncio.sleep(max(0.0, min(interval, timeout_s - (time.monotonic() - start))))
            interval = min(max_interval_s, interval * 1.5)

    async def model_info(self) -> dict:
        return await self._get_json("/model_info")

    async def server_info(self) -> dict:
        return await self._get_json("/server_info")

    # ----------------------------------------------------------------------------------- generation
    async def generate(
        self,
        input_ids: list[int] | list[list[int]],
        sampling_params: dict | list[dict],
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        rid: str | None = None,
        return_routed_experts: bool = False,
        return_indexer_topk: bool = False,
    ) -> dict | list[dict]:
        """POST /generate with token ids; a flat list gives one object, a list of lists (or n>1) a list.
        `sampling_params` is one dict for every item, or a list with one per item. The two `return_*`
        flags ask for the engine's routing and indexer choices of every position (from position 0)."""
        if not input_ids or (isinstance(input_ids[0], list) and not all(input_ids)):
            raise ValueError("generate: input_ids must be a non-empty list of token ids (or of such lists)")
        body: dict[str, Any] = {
            "input_ids": input_ids,
            "sampling_params": sampling_params,
            "return_logprob": return_logprob,
            "logprob_start_len": logprob_start_len,
        }
        if rid is not None:
            body["rid"] = rid
        if return_routed_experts:
            body["return_routed_experts"] = True
            body["routed_experts_start_len"] = 0
        if return_indexer_topk:
            body["return_indexer_topk"] = True
        self.in_flight += 1
        try:
            async with self._state().semaphore:
                response = await self._request("POST", "/generate", body=body, retry=True)
        finally:
            self.in_flight -= 1
        return _json(response, self.base_url, "/generate")

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        await self._control("/abort_request", {"rid": rid, "abort_all": abort_all})

    async def pause_generation(self, mode: PauseMode | str = PauseMode.abort) -> Any:
        return await self._control("/pause_generation", {"mode": choice(PauseMode, mode, "pause mode").value})

    async def continue_generation(self) -> Any:
        return await self._control("/continue_generation", {})

    async def flush_cache(self, timeout_s: float = 0.0) -> str:
        """POST /flush_cache; SGLang answers plain text, 400 "Flush cache failed." when not idle."""
        params = {"timeout": timeout_s} if timeout_s > 0 else None
        response = await self._request("POST", "/flush_cache", params=params, retry=False, admin=True)
        return response.text

    async def freeze_gc(self) -> str:
        """POST /freeze_gc: the engine's processes move every live object out of the garbage collector's
        reach (SGLang answers plain text). Worth it once the model is loaded and warm: a full collection
        otherwise walks every object of the imports and the model, which stalls a batch."""
        response = await self._request("POST", "/freeze_gc", retry=False, admin=True)
        return response.text

    # ----------------------------------------------------------------------------------- weights
    async def begin_weight_update(self) -> dict:
        return await self._weights("/begin_weight_update", {})

    async def end_weight_update(self) -> dict:
        return await self._weights("/end_weight_update", {})

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> dict:
        """Blocks until the server joined the rendezvous: call it while the trainer joins too."""
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        return await self._weights("/init_weights_update_group", body)

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str = "weight_update_group",
        flush_cache: bool = False,
        weight_version: str | None = None,
        load_format: str | None = None,
    ) -> dict:
        """Returns once the server received and loaded every tensor; the caller broadcasts meanwhile."""
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"names ({len(names)}), dtypes ({len(dtypes)}), shapes ({len(shapes)}) differ")
        bad = [d for d in dtypes if not d or "." in d]
        if bad:  # "torch.bfloat16" makes the server fail after the broadcasts were posted: a hang
            raise ValueError(f"dtypes must be bare torch names like 'bfloat16', got {bad[:3]}")
        body: dict[str, Any] = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            body["weight_version"] = weight_version
        if load_format is not None:
            body["load_format"] = load_format
        return await self._weights("/update_weights_from_distributed", body)

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[str],
        load_format: str | None = None,
        flush_cache: bool = False,
        weight_version: str | None = None,
    ) -> dict:
        """One base64 pickle of tensor handles per tensor-parallel rank (`dsv4rl.wire.tensor_payload`);
        returns once the server loaded them (so the caller keeps the tensors alive until then)."""
        if not serialized_named_tensors or not all(isinstance(s, str) for s in serialized_named_tensors):
            raise ValueError("serialized_named_tensors must be one base64 string per tensor-parallel rank")
        body: dict[str, Any] = {
            "serialized_named_tensors": list(serialized_named_tensors),
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            body["weight_version"] = weight_version
        if load_format is not None:
            body["load_format"] = load_format
        return await self._weights("/update_weights_from_tensor", body)

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Give back the memory of `tags` (weights, kv_cache, cuda_graph; None: all). The engine must be
        idle; SGLang needs `--enable-memory-saver` to free anything."""
        await self._control("/release_memory_occupation", {"tags": None if tags is None else list(tags)})

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Take back the memory of `tags` (None: all). Resumed weights hold no useful values until the next
        weight update (unless SGLang keeps a CPU backup, `--enable-weights-cpu-backup`)."""
        await self._control("/resume_memory_occupation", {"tags": None if tags is None else list(tags)})

    async def weights_checker(
        self, action: str = "checksum", skip_tensor_list: list[str] | None = None
    ) -> dict:
        """POST /weights_checker: checksum, snapshot, reset_tensors or compare (success false raises)."""
        body: dict[str, Any] = {"action": action}
        if skip_tensor_list is not None:
            body["skip_tensor_list"] = list(skip_tensor_list)
        return await self._weights("/weights_checker", body)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return await self._weights("/destroy_weights_update_group", {"group_name": group_name})

    async def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> dict:
        body = {"new_version": new_version, "abort_all_requests": abort_all_requests}
        return await self._weights("/update_weight_version", body)

    async def aclose(self) -> None:
        """Close this event loop's connections (others close with their loop)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            state = self._states.pop(loop, None)
        if state is not None:
            await state.http.aclose()


def _json(response: httpx.Response, engine: str, endpoint: str) -> Any:
    try:
        return orjson.loads(response.content)
    except orjson.JSONDecodeError as exc:
        raise EngineError(engine, endpoint, f"expected JSON, got {response.text[:200]!r}") from exc


class EnginePool:
    """Several engines: `generate` goes to the least-loaded one (round-robin among ties),
    control calls are `broadcast` to all of them at once."""

    def __init__(self, clients: Sequence[EngineClient]):
        if not clients:
            raise ValueError("EnginePool needs at least one EngineClient")
        self.clients = list(clients)
        self._turn = itertools.count()

    @classmethod
    def from_urls(cls, urls: Sequence[str], **client_kwargs: Any) -> EnginePool:
        return cls([EngineClient(url, **client_kwargs) for url in urls])

    def __len__(self) -> int:
        return len(self.clients)

    def pick(self) -> EngineClient:
        start = next(self._turn) % len(self.clients)
        order = self.clients[start:] + self.clients[:start]
        return min(order, key=lambda c: c.in_flight)

    async def generate(self, *args: Any, **kwargs: Any) -> dict | list[dict]:
        return await self.pick().generate(*args, **kwargs)

    async def broadcast(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call `method` on every engine concurrently; wait for all, then raise the first failure."""
        if method.startswith("_") or not inspect.iscoroutinefunction(getattr(EngineClient, method, None)):
            public = sorted(
                m
                for m in vars(EngineClient)
                if not m.startswith("_") and inspect.iscoroutinefunction(getattr(EngineClient, m))
            )
            raise ValueError(
                f"EnginePool.broadcast: unknown EngineClient method {method!r}; choose from {public}"
            )
        results = await asyncio.gather(
            *(getattr(c, method)(*args, **kwargs) for c in self.clients), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            first = errors[0]
            if len(errors) > 1:
                first.add_note(f"{len(errors) - 1} more engine(s) failed: " + "; ".join(map(str, errors[1:])))
            raise first
        return results

    async def wait_healthy(self, timeout_s: float) -> None:
        await self.broadcast("wait_healthy", timeout_s)

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self.clients))
