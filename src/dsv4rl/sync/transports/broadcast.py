"""Weights by broadcast: the trainer hosts a process group with every engine and broadcasts each bucket.

`connect` builds the group (SGLang 0.5.23's `/init_weights_update_group`): this process joins as rank 0
on a helper thread while every engine, POSTed at once, joins at `rank_offset = 1 + ranks of the engines
before it`. `close` destroys it on the engines (`/destroy_weights_update_group`) and here.

`BroadcastTransport.send` POSTs the bucket's names, dtypes and shapes to `/update_weights_from_distributed`
on every engine and, while those requests are in flight, broadcasts the tensors in `names` order over the
weight-update group (or one uint8 buffer with `load_format="flattened_bucket"`). It returns once every
engine answered that it received and loaded the bucket.

Failures never hang for long: a POST that fails while broadcasts are outstanding (the engine refused
the request before receiving) is reported at once with the engine's message; a peer that stops
mid-transfer trips `timeout_s`. Either way `broken` is set: the group must be rebuilt.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from dsv4rl.sync.errors import WeightSyncError, engine_name, post_error, post_states
from dsv4rl.sync.loop_thread import LoopThread
from dsv4rl.wire.engine_api import EngineAPI
from dsv4rl.wire.layout import FLATTENED_BUCKET, NamedTensor, bucket_metadata, flatten_bucket, parse_dtype
from dsv4rl.wire.process_group import (
    destroy_custom_process_group,
    format_init_method,
    init_custom_process_group,
    transport_view,
)

__all__ = ["BroadcastTransport"]

log = logging.getLogger("dsv4rl.sync")
_POLL_S = 0.05  # how soon a refused request, a failed broadcast or the timeout is noticed


class BroadcastTransport:
    """Sends buckets to `clients` over the group it hosts at `master_address:master_port` (this process is
    rank 0 of it); `engine_ranks[i]` is engine i's tensor-parallel size, the ranks it adds to the group."""

    def __init__(
        self,
        clients: Sequence[EngineAPI],
        http: LoopThread,
        *,
        group_name: str,
        backend: str,
        master_address: str,
        master_port: int,
        engine_ranks: Sequence[int],
        device: torch.device,
        timeout_s: float,
        load_format: str | None = None,
    ) -> None:
        self.clients = list(clients)
        self.http = http
        self.group_name = group_name
        self.backend = backend
        self.master_address = master_address
        self.master_port = master_port
        self.engine_ranks = list(engine_ranks)
        self.world_size = 1 + sum(self.engine_ranks)
        self.device = device
        self.timeout_s = timeout_s
        self.load_format = load_format
        self.group: dist.ProcessGroup | None = None  # set by connect()
        self.broken: str | None = None  # why the group can no longer be used, once a transfer failed

    def connect(self) -> None:
        """Create the group: every engine joins from its POST while this process joins as rank 0."""
        posts, offset = [], 1
        for client, ranks in zip(self.clients, self.engine_ranks, strict=True):
            coro = client.init_weights_update_group(
                self.master_address,
                self.master_port,
                offset,
                self.world_size,
                self.group_name,
                self.backend,
            )
            posts.append((client, self.http.submit(coro)))
            offset += ranks
        joined: dict[str, Any] = {}

        def join() -> None:
            try:
                joined["pg"] = init_custom_process_group(
                    self.backend,
                    format_init_method(self.master_address, self.master_port),
                    world_size=self.world_size,
                    rank=0,
                    group_name=self.group_name,
                    timeout=self.timeout_s,
                )
            except BaseException as exc:  # reported by the waiting thread
                joined["error"] = exc

        thread = threading.Thread(target=join, name="dsv4rl-weight-sync-join", daemon=True)
        thread.start()
        deadline = time.monotonic() + self.timeout_s + 10
        where = f"{self.master_address}:{self.master_port} (group {self.group_name!r}, {self.backend})"
        while True:
            for client, future in posts:
                if future.done() and future.exception() is not None:
                    raise WeightSyncError(
                        f"engine {engine_name(client)} could not join the weight-update group at "
                        f"{where}: {future.exception()}. The trainer's half-built group is abandoned "
                        f"(it times out after sync.timeout_s={self.timeout_s:g} s)."
                    )
            if "error" in joined:
                error = joined["error"]
                raise WeightSyncError(
                    f"the trainer could not create the weight-update group at {where}: {error!r}"
                )
            if not thread.is_alive() and all(f.done() for _, f in posts):
                break
            if time.monotonic() > deadline:
                waiting = [engine_name(c) for c, f in posts if not f.done()]
                raise WeightSyncError(
                    f"timed out joining the weight-update group at {where}; "
                    f"still waiting for: {waiting or ['the trainer rendezvous']}"
                )
            time.sleep(0.01)
        self.group, self.broken = joined["pg"], None
        log.info("weight-update group %s ready: world_size=%d", where, self.world_size)

    def send(
        self, bucket: list[NamedTensor], weight_version: str | None, what: str, *, flush_cache: bool = False
    ) -> int:
        """Send one bucket (already in wire order) to every engine; returns its payload bytes. The last
        bucket sets `weight_version` and flushes the prefix cache (`flush_cache`) in the same request."""
        meta = bucket_metadata(bucket)
        for name, dtype in zip(meta["names"], meta["dtypes"], strict=True):
            try:
                parse_dtype(dtype)
            except ValueError as error:
                raise WeightSyncError(f"{name}: {error}") from None
        options = {
            "flush_cache": flush_cache,
            "weight_version": weight_version,
            "load_format": self.load_format,
        }
        posts = [
            (
                client,
                self.http.submit(
                    client.update_weights_from_distributed(
                        meta["names"], meta["dtypes"], meta["shapes"], self.group_name, **options
                    )
                ),
            )
            for client in self.clients
        ]
        # The requests carry only names, dtypes and shapes: the engines parse and check them while the
        # tensors are packed here
        try:
            tensors = [t.detach().to(self.device).contiguous() for _, t in bucket]
            if self.load_format == FLATTENED_BUCKET:
                payload = [flatten_bucket(list(zip(meta["names"], tensors, strict=True)), self.device)]
            else:
                payload = [transport_view(t, self.backend) for t in tensors]
        except Exception as exc:
            self.broken = f"{what} could not be packed after its request went out"
            raise WeightSyncError(
                f"{what}: packing its tensors failed after the request was sent ({exc!r}); the engines "
                "wait for a broadcast that will not come, so the group is unusable: close() and connect()"
            ) from exc
        works = [dist.broadcast(t, src=0, group=self.group, async_op=True) for t in payload]
        self._wait(works, posts, what)
        return sum(t.numel() * t.element_size() for t in tensors)

    def _wait(self, works: list[Any], posts: list[tuple[Any, cf.Future]], what: str) -> None:
        """Until every engine answered. An engine answers only once it received and loaded the whole
        bucket, so this blocks on the answers (no busy polling), waking every `_POLL_S` to notice a
        refused request (its broadcasts will never be received), a failed broadcast, or the timeout."""
        deadline = time.monotonic() + self.timeout_s
        futures = [f for _, f in posts]
        while True:
            _, pending = cf.wait(futures, timeout=_POLL_S, return_when=cf.FIRST_EXCEPTION)
            failed = [(c, f) for c, f in posts if f.done() and f.exception() is not None]
            if failed:
                self.broken = f"{what} was refused while its broadcasts were outstanding"
                works.clear()  # a traceback must not keep the group's pending work alive
                raise WeightSyncError(
                    f"{what}: " + "; ".join(post_error(c, f) for c, f in failed) + ". Its broadcasts "
                    "were never received, so the group is unusable: close() and connect() again "
                    "(engines are left paused)."
                )
            if not pending:
                break
            try:
                for work in works:
                    if work.is_completed():
                        work.wait()  # raises at once when the broadcast failed
            except Exception as exc:
                self.broken = f"{what} broadcast failed"
                raise WeightSyncError(f"{what}: broadcast failed: {exc}; {post_states(posts)}") from exc
            if time.monotonic() > deadline:
                self.broken = f"{what} timed out"
                works.clear()
                raise WeightSyncError(
                    f"{what}: not received and loaded within sync.timeout_s={self.timeout_s:g} s; "
                    + post_states(posts)
                )
        try:
            for work in works:
                work.wait()
        except Exception as exc:
            self.broken = f"{what} broadcast failed"
            raise WeightSyncError(f"{what}: broadcast failed: {exc}; {post_states(posts)}") from exc

    def close(self) -> None:
        """Destroy the group on the engines and here (a broken group too); safe to call twice."""
        if self.group is None:
            return
        posts = [(c, self.http.submit(c.destroy_weights_update_group(self.group_name))) for c in self.clients]
        group, self.group, self.broken = self.group, None, None
        errors = []
        try:
            destroy_custom_process_group(group)
        except Exception as exc:
            errors.append(f"trainer: {exc!r}")
        del group  # a shut-down gloo group still referenced at interpreter exit can abort the process
        cf.wait([f for _, f in posts], timeout=30)
        errors += [post_error(c, f) for c, f in posts if not f.done() or f.exception() is not None]
        if errors:
            log.warning("closing the weight-update group: %s", "; ".join(errors))
