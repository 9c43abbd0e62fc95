"""The last stage of a weight sync: one bucket to every engine, the request POSTed while rank 0 broadcasts.

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
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from dsv4rl.sync.buckets import FLATTENED_BUCKET, NamedTensor, bucket_metadata, flatten_bucket, parse_dtype
from dsv4rl.sync.loop_thread import LoopThread
from dsv4rl.sync.process_group import transport_view

__all__ = ["BroadcastTransport", "WeightSyncError", "engine_name"]

_POLL_S = 0.05  # how soon a refused request, a failed broadcast or the timeout is noticed


class WeightSyncError(RuntimeError):
    """A weight sync step failed; the message names the engine and step and says how to recover."""


def engine_name(client: Any) -> str:
    return str(getattr(client, "base_url", client))


class BroadcastTransport:
    """Sends buckets to `clients` over `group` (this process is rank 0 of it)."""

    def __init__(
        self,
        clients: Sequence[Any],
        group: dist.ProcessGroup,
        http: LoopThread,
        *,
        group_name: str,
        backend: str,
        device: torch.device,
        timeout_s: float,
        load_format: str | None = None,
    ) -> None:
        self.clients = list(clients)
        self.group = group
        self.http = http
        self.group_name = group_name
        self.backend = backend
        self.device = device
        self.timeout_s = timeout_s
        self.load_format = load_format
        self.broken: str | None = None  # why the group can no longer be used, once a transfer failed

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
        # tensors are packed here (a tiny model's 1 MB bucket takes 1-3 ms to pack)
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


def post_error(client: Any, future: cf.Future) -> str:
    if not future.done():
        return f"engine {engine_name(client)}: no answer"
    exc = future.exception()
    return str(exc) if engine_name(client) in str(exc) else f"engine {engine_name(client)}: {exc!r}"


def post_states(posts: list[tuple[Any, cf.Future]]) -> str:
    return "; ".join(
        post_error(c, f) if not f.done() or f.exception() else f"engine {engine_name(c)}: ok"
        for c, f in posts
    )
