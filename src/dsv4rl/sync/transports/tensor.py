"""The last stage of a colocated weight sync: each bucket to every engine by handle, over HTTP alone.

`TensorTransport.send` copies the bucket into one fresh buffer on the trainer's device, pickles handles to
that buffer (`dsv4rl.wire.tensor_payload`: CUDA IPC on GPUs, /dev/shm segments on CPU), one per
tensor-parallel rank of each engine, and POSTs them to `/update_weights_from_tensor` on every engine at
once (SGLang 0.5.23: rank i of an engine reads entry i, and each entry must be pickled on its own so CUDA
IPC reference counts stay right, `srt/managers/tp_worker.py` deserialize_own_rank). It returns once every
engine answered that it loaded the bucket, which an engine does only after copying out of the shared
buffer; only then is the buffer let go (slime keeps its buckets alive the same way).

It is a `Transport` like `BroadcastTransport`, so `WeightSync` puts either at the end of the same pipeline.
No process group is involved: `connect` and `close` have nothing to build or tear down, a refused request
breaks nothing, and `broken` stays None.
One cost of a refusal on CPU: pickling a shared segment takes a reference that only the opening side gives
back, so a payload an engine refused unopened keeps its segment in /dev/shm until the trainer exits
(torch's shm manager removes it then); a refused push stops the run anyway.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
from collections.abc import Sequence

import torch

from dsv4rl.sync.errors import WeightSyncError, post_error, post_states
from dsv4rl.sync.loop_thread import LoopThread
from dsv4rl.wire.engine_api import EngineAPI
from dsv4rl.wire.layout import NamedTensor, sort_for_flattening
from dsv4rl.wire.tensor_payload import pack_bucket, serialize

__all__ = ["TensorTransport"]

log = logging.getLogger("dsv4rl.sync")


class TensorTransport:
    """Sends buckets to colocated `clients`; `engine_ranks[i]` is engine i's tensor-parallel size."""

    def __init__(
        self,
        clients: Sequence[EngineAPI],
        http: LoopThread,
        *,
        device: torch.device,
        timeout_s: float,
        load_format: str | None = None,
        engine_ranks: Sequence[int] | None = None,
    ) -> None:
        self.clients = list(clients)
        self.http = http
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.load_format = load_format
        self.engine_ranks = [1] * len(self.clients) if engine_ranks is None else list(engine_ranks)
        self.broken: str | None = None  # never set: a failed request leaves nothing half-built

    def connect(self) -> None:
        """Nothing to join: the engines take the handles over HTTP alone."""
        log.info("weights go to %d colocated engine(s) by tensor handles", len(self.clients))

    def send(
        self, bucket: list[NamedTensor], weight_version: str | None, what: str, *, flush_cache: bool = False
    ) -> int:
        """Send one bucket to every engine; returns its payload bytes. The last bucket sets
        `weight_version` and flushes the prefix cache (`flush_cache`) in the same request."""
        payload, buffer = pack_bucket(sort_for_flattening(bucket), self.load_format, self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the copy is done before another process reads it
        posts = []
        for client, ranks in zip(self.clients, self.engine_ranks, strict=True):
            entries = [serialize(payload) for _ in range(ranks)]
            request = client.update_weights_from_tensor(
                entries, load_format=self.load_format, flush_cache=flush_cache, weight_version=weight_version
            )
            posts.append((client, self.http.submit(request)))
        try:
            _, pending = cf.wait([future for _, future in posts], timeout=self.timeout_s)
        finally:
            del payload  # the handles are pickled; `buffer` stays until every engine answered or gave up
        failed = [(client, future) for client, future in posts if future.done() and future.exception()]
        if failed:
            raise WeightSyncError(f"{what}: " + "; ".join(post_error(c, f) for c, f in failed))
        if pending:
            raise WeightSyncError(
                f"{what}: not loaded within sync.timeout_s={self.timeout_s:g} s; {post_states(posts)}"
            )
        return buffer.numel()

    def close(self) -> None:
        """Nothing to tear down."""
