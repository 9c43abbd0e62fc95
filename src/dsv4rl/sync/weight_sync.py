"""The trainer side of checkpoint-free weight sync: rank 0 broadcasts the weights to every engine.

Protocol (SGLang 0.5.23's `/update_weights_from_distributed`): the trainer is rank 0 of a custom process
group; engine i joins at `rank_offset = 1 + ranks of engines before it`. A push opens a weight-update
session, streams the weights through the pipeline (`dsv4rl.sync.pipeline`: native names -> wire format
-> buckets) into the transport (`dsv4rl.sync.transports.broadcast`: each bucket's request POSTed to every
engine while the tensors are broadcast) and closes the session: `2 + buckets` requests per engine. The last
bucket carries the weight version and flushes the prefix cache (SGLang 0.5.23 sets both from the bucket
request: no `/flush_cache` or `/update_weight_version` call is needed). Pausing generation around the
push (`pause=True`) is for when requests may be in flight (asynchronous rollouts); the synchronous loop
syncs between rollouts and skips it. The POSTs run on a private asyncio loop
in a helper thread, so `WeightSync` is a blocking API callable from any thread (not from inside a
running event loop's thread without `asyncio.to_thread`).

A pipeline-parallel trainer has one source per stage (`dsv4rl.sync.stages`): each source owns its own
group (its own name and port) with every engine and only `send`s; rank 0 wraps all the sends in one
`begin_update` / `finish_update`.

Colocated engines (`transport=SyncTransport.tensor`) take the same buckets by handle instead
(`dsv4rl.sync.transports.tensor`, SGLang's `/update_weights_from_tensor`): no group, no port, the same
session around them.

Failures never hang for long; when a transfer fails the group is marked broken: `close()` then
`connect()` again.

A failed push leaves the engines with part of an update. SGLang closes a session by post-processing every
quantized module again, re-sent or not (`dsv4rl.quant.sglang_moe`). Where that is idempotent the session is
closed and a later push may run on the same engines. Where it is not (`non_idempotent` says why, e.g. aiter
re-shuffling MoE weights in place on ROCm), closing would corrupt every module the failed push did not
re-send, and SGLang itself calls a model whose load failed "partially updated ... discard the whole
weights" (`sglang/srt/model_executor/model_runner_components/weight_updater.py:331-340`): the session is
left open (SGLang then refuses any new session on those engines), every later push is refused, and the
error says the engines must be restarted. The run stops; it never retries on the same engines. The
trainer records it (`dsv4rl.faults.failed_push`): the run ends with exit 76, and a relaunch with
`resume=auto` (the sbatch script requeues the job) starts fresh engines from the last checkpoint.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dsv4rl.config.choices import CommBackend, SyncTransport, choice
from dsv4rl.config.schema import SyncConfig
from dsv4rl.config.sglang_choices import PauseMode, SyncLoadFormat
from dsv4rl.model.wire_format import WireFormat
from dsv4rl.sync.errors import WeightSyncError, engine_name
from dsv4rl.sync.loop_thread import LoopThread
from dsv4rl.sync.pipeline import FiniteGuard, wire_buckets
from dsv4rl.sync.transports.base import Transport
from dsv4rl.sync.transports.broadcast import BroadcastTransport
from dsv4rl.sync.transports.tensor import TensorTransport
from dsv4rl.wire.checksum import checksums
from dsv4rl.wire.engine_api import EngineAPI
from dsv4rl.wire.layout import FLATTENED_BUCKET, NamedTensor, sort_for_flattening

__all__ = ["SyncStats", "WeightSync", "WeightSyncError"]

log = logging.getLogger("dsv4rl.sync")
OPEN_SESSION = "opening the weight-update session (pause_generation when pausing, begin_weight_update)"
RESTART = (
    "these engines' weight post-processing is not idempotent ({why}): closing the session would re-process "
    "every module the push did not re-send and corrupt it, so it stays open and the engines keep a partial "
    "update they cannot repair. Stop the run and restart the engines (the run ends with exit 76 and "
    "<run.dir>/FAILED_PUSH; `dsv4rl train ... resume=auto` starts new ones from the last checkpoint, and the "
    "sbatch script requeues the job so); never push to these engines again"
)


@dataclass
class SyncStats:
    """One push: payload bytes, wall seconds (pause to continue), buckets, tensors, where the time went."""

    bytes: int = 0
    seconds: float = 0.0
    buckets: int = 0
    tensors: int = 0
    transfer_seconds: float = 0.0  # inside the bucket transfers (POST ∥ broadcast ∥ engine load)
    pipeline_seconds: float = 0.0  # gathering, renaming, quantizing (and checksumming) into buckets
    checksums: dict[str, str] = field(default_factory=dict)  # sha256 of each tensor sent, when recorded
    sources: int = 1  # senders whose transfers ran side by side (one per pipeline stage)
    transport: SyncTransport = SyncTransport.broadcast  # how the buckets travelled

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def transfer_gb_per_s(self) -> float:
        return self.bytes / self.transfer_seconds / 1e9 if self.transfer_seconds > 0 else 0.0

    @property
    def control_seconds(self) -> float:
        """The control requests around the transfers: pause, begin, end, flush, version, continue."""
        return max(0.0, self.seconds - self.transfer_seconds - self.pipeline_seconds)


class WeightSync:
    """Pushes trainer weights to SGLang-protocol engines over a broadcast group (trainer = rank 0), or to
    colocated engines by tensor handles.

    `clients` are `EngineClient`s (or anything else with `EngineAPI`'s async methods). `engine_ranks[i]`
    is engine i's TP size, the ranks it adds to the group (1 for the reference engine). `load_format`
    (a `SyncLoadFormat`: one broadcast per tensor, or one per bucket) defaults to `sync.load_format`.
    `wire_format` converts native tensors to what the engines hold (None: sent as they are); the trainer
    sets it once it knows what the engines serve.
    `group_name` names this sender's group (default `sync_cfg.group_name`; one per pipeline stage).
    `pause`: pause generation (`sync.pause_mode`) from the session's start to its end.
    `transport`: `broadcast` over a group this sender hosts at `master_address:master_port`, or `tensor`
    (colocated engines: handles over HTTP; the address, port and group are not used).
    `non_idempotent`: why the engines' post-processing cannot be repeated (`sglang_moe.restart_reason`), or
    None: a failed push then leaves them `spent` instead of closing their session.
    """

    def __init__(
        self,
        clients: Sequence[EngineAPI],
        sync_cfg: SyncConfig,
        backend: CommBackend | str,
        master_address: str,
        master_port: int,
        *,
        engine_ranks: Sequence[int] | None = None,
        load_format: SyncLoadFormat | str | None = None,
        device: torch.device | str | None = None,
        wire_format: WireFormat | None = None,
        group_name: str | None = None,
        pause: bool = True,
        transport: SyncTransport = SyncTransport.broadcast,
        non_idempotent: str | None = None,
    ) -> None:
        if not clients:
            raise ValueError("WeightSync needs at least one engine client")
        # the recipe's values are validated once (dsv4rl.checks); here they only become the schema's enums
        backend = choice(CommBackend, str(backend).lower(), "comm.backend")
        self.pause_mode = choice(PauseMode, sync_cfg.pause_mode, "sync.pause_mode")
        chosen = choice(
            SyncLoadFormat,
            load_format if load_format is not None else sync_cfg.load_format,
            "sync.load_format",
        )
        load_format = None if chosen == SyncLoadFormat.per_tensor else FLATTENED_BUCKET  # SGLang's values
        ranks = [1] * len(clients) if engine_ranks is None else [int(r) for r in engine_ranks]
        if len(ranks) != len(clients) or any(r < 1 for r in ranks):
            raise ValueError(f"engine_ranks must give a positive rank count per engine, got {engine_ranks}")
        self.clients = list(clients)
        self.all_clients, self.all_ranks = list(clients), ranks  # every engine, whether in the group or not
        self.cfg = sync_cfg
        self.group_name = group_name or sync_cfg.group_name
        self.base_group_name = self.group_name
        self.regroups = 0  # groups rebuilt after an engine was lost or came back
        self.backend = backend
        self.master_address = master_address
        self.master_port = int(master_port)
        self.engine_ranks = ranks
        self.world_size = 1 + sum(ranks)
        self.load_format = load_format
        self.wire_format = wire_format
        self.pause = pause
        self.transport_kind = SyncTransport(transport)
        if device is None:
            device = (
                "cpu" if backend == CommBackend.gloo else torch.device("cuda", torch.cuda.current_device())
            )
        self.device = torch.device(device)
        # Held around each bucket's transfer. Several senders share the engines through one lock
        # (dsv4rl.sync.stages): an engine takes one request at a time, so two buckets in flight to two
        # engines in opposite orders would deadlock the broadcasts.
        self.bucket_lock: contextlib.AbstractContextManager = contextlib.nullcontext()
        self.transport: Transport | None = None
        self._broken: str | None = None
        self.non_idempotent = non_idempotent
        self._spent: str | None = None  # why these engines must be restarted; close() keeps it
        self._http: LoopThread | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------------------ plumbing
    @property
    def connected(self) -> bool:
        return self.transport is not None

    @property
    def spent(self) -> str | None:
        """Why these engines must be restarted before any push (a failed push on non-idempotent engines)."""
        return self._spent

    def _loop(self) -> LoopThread:
        if self._http is None:
            self._http = LoopThread()
        return self._http

    def _call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call `method` on every engine concurrently; raise naming each engine that failed."""
        loop = self._loop()
        futures = [(c, loop.submit(getattr(c, method)(*args, **kwargs))) for c in self.clients]
        return self._answers(method, futures)

    def _answers(self, what: str, futures: list[tuple[Any, cf.Future]]) -> list[Any]:
        """Each engine's answer to the requests in `futures`; raise naming each engine that failed."""
        results, errors = [], []
        for client, future in futures:
            try:
                results.append(future.result(timeout=self.cfg.timeout_s + 5))
            except Exception as exc:  # EngineError names engine and endpoint; add it if something else
                errors.append(
                    exc if engine_name(client) in str(exc) else f"engine {engine_name(client)}: {exc!r}"
                )
        if errors:
            raise WeightSyncError(f"{what} failed: " + "; ".join(map(str, errors)))
        return results

    # ------------------------------------------------------------------------------------------ connect
    def connect(self) -> None:
        """Build the transport of `transport_kind` and connect it: join the broadcast group (every engine
        joins from its POST while this process joins as rank 0), or nothing for tensor handles."""
        with self._lock:
            if self._spent:
                raise WeightSyncError(self._spent)
            if self.transport is not None:
                raise WeightSyncError("already connected; call close() before connect()")
            transport = self._build_transport()
            transport.connect()
            self.transport, self._broken = transport, None

    def regroup(self, members: Sequence[int], urls: Sequence[str] | None = None) -> None:
        """Rebuild the group with the engines `members` (indices into the clients this sync was made with):
        an engine was lost or came back. A communicator with a dead member cannot be used again, so the old
        group is destroyed on its members that still answer and here, and a new one is created under a new
        name (SGLang keys groups by name) on the same port (the trainer's store serves every group).
        `urls`: every engine's address as rank 0 knows it (one restarted on another port moved)."""
        with self._lock:
            if self._spent:
                raise WeightSyncError(self._spent)
            for client, url in zip(self.all_clients, urls or (), strict=False):
                if getattr(client, "base_url", url) != url:
                    client.move_to(url)
            transport, self.transport, self._broken = self.transport, None, None
            if transport is not None:
                transport.close()
            self.clients = [self.all_clients[i] for i in members]
            self.engine_ranks = [self.all_ranks[i] for i in members]
            self.world_size = 1 + sum(self.engine_ranks)
            self.regroups += 1
            self.group_name = f"{self.base_group_name}-regroup{self.regroups}"
            transport = self._build_transport()
            transport.connect()
            self.transport = transport
        log.info("weight-update group %s rebuilt with engines %s", self.group_name, list(members))

    def _build_transport(self) -> Transport:
        if self.transport_kind == SyncTransport.tensor:
            return TensorTransport(
                self.clients,
                self._loop(),
                device=self.device,
                timeout_s=self.cfg.timeout_s,
                load_format=self.load_format,
                engine_ranks=self.engine_ranks,
            )
        return BroadcastTransport(
            self.clients,
            self._loop(),
            group_name=self.group_name,
            backend=self.backend,
            master_address=self.master_address,
            master_port=self.master_port,
            engine_ranks=self.engine_ranks,
            device=self.device,
            timeout_s=self.cfg.timeout_s,
            load_format=self.load_format,
        )

    # ------------------------------------------------------------------------------------------ push
    def push(
        self, named_weights: Iterable[NamedTensor], version: str, *, record_checksums: bool = False
    ) -> SyncStats:
        """Open a session (pausing first when `pause`), send every bucket (the last one sets the version
        and flushes), close the session.

        `record_checksums` keeps the sha256 of every tensor as it leaves the pipeline (before the
        transport), for comparison with what the engines hold. On failure the engines stay paused with a
        partial update and the error says what failed; on non-idempotent engines it is a WeightSyncError
        that also says they must be restarted (`spent`).
        """
        start = time.monotonic()
        opening = self._open_session()  # answered while the pipeline builds the first bucket
        try:
            stats = self.send(named_weights, version, record_checksums=record_checksums, opening=opening)
        except Exception as exc:
            self._abandon_after(opening)
            if self._spent:
                raise WeightSyncError(f"{exc}\n{self._spent}") from exc
            raise
        self.close_session(None)
        stats.seconds = time.monotonic() - start
        log.info(
            "weights %s pushed: %d tensors in %d buckets, %.1f MB in %.2f s (%.3f GB/s)",
            *(version, stats.tensors, stats.buckets, stats.bytes / 1e6, stats.seconds, stats.gb_per_s),
        )
        return stats

    def begin_update(self) -> None:
        """Open the engines' weight-update session (pausing generation first when `pause`)."""
        self._answers(OPEN_SESSION, self._open_session())

    def _open_session(self) -> list[tuple[Any, cf.Future]]:
        """Send each engine its session-opening requests (pause, when `pause`, then begin) without waiting
        for the answers: a push gathers and packs its first bucket meanwhile (for a small model the round
        trips take about as long as the packing)."""
        with self._lock:
            self._check_usable()
            loop = self._loop()
            return [(client, loop.submit(self._open_engine_session(client))) for client in self.clients]

    async def _open_engine_session(self, client: EngineAPI) -> Any:
        if self.pause:
            await client.pause_generation(mode=self.pause_mode)
        return await client.begin_weight_update()

    def _abandon_after(self, opening: list[tuple[Any, cf.Future]]) -> None:
        """A push failed: once the opening requests are answered, abandon the sessions that opened
        (`abandon_update`: closed, or left open on non-idempotent engines)."""
        cf.wait([future for _, future in opening], timeout=self.cfg.timeout_s + 5)
        if any(future.done() and future.exception() is None for _, future in opening):
            self.abandon_update()

    def send(
        self,
        named_weights: Iterable[NamedTensor],
        version: str | None,
        *,
        record_checksums: bool = False,
        opening: list[tuple[Any, cf.Future]] | None = None,
    ) -> SyncStats:
        """Every bucket of `named_weights` over this group, inside an open session; `version` (or None)
        rides on the last bucket, which then also flushes the cache. `seconds` is the time spent here.
        `opening`: the session's opening requests still in flight, awaited before the first bucket."""
        with self._lock:
            self._check_usable()
            stats = SyncStats(transport=self.transport_kind)
            start = time.monotonic()
            try:
                self._send_all(named_weights, version, stats, record_checksums, opening)
            except Exception:
                self._broken = self._broken or self.transport.broken
                raise
            stats.seconds = time.monotonic() - start
            return stats

    def abandon_update(self) -> None:
        """After a failed send. Idempotent engines: close the session so a later push can open one (the
        engines stay paused). Others (`non_idempotent`): leave it open, since closing would re-process the
        modules that were not re-sent, and refuse every later push on these engines (`spent`)."""
        with self._lock:
            if self.non_idempotent is not None:
                self._spend()
                log.error("after a failed push: %s", self._spent)
                return
            try:
                self._call_all("end_weight_update")
            except WeightSyncError as exc:
                log.warning("after a failed push: %s", exc)

    def engines_replaced(self) -> None:
        """Every engine of a spent group was restarted: fresh processes that hold the model they loaded,
        nothing half post-processed; the next `regroup` builds their group and a full push may follow."""
        with self._lock:
            self._spent = None

    def _spend(self) -> None:
        self._spent = RESTART.format(why=self.non_idempotent)

    def close_session(self, version: str | None) -> None:
        """`finish_update`; when that fails on non-idempotent engines they are `spent`: what each engine
        post-processed is not known."""
        try:
            self.finish_update(version)
        except WeightSyncError as exc:
            if self.non_idempotent is None:
                raise
            self._spend()
            raise WeightSyncError(f"{exc}\n{self._spent}") from exc

    def finish_update(self, version: str | None) -> None:
        """Close the session (the engines' post-load processing) and continue generation if paused.
        `version`: not yet delivered on a bucket (several senders): flush and set it here."""
        with self._lock:
            self._call_all("end_weight_update")
            if version is not None:
                if self.flush_with_update:
                    self._call_all("flush_cache")
                self._call_all("update_weight_version", version, abort_all_requests=False)
            if self.pause:
                self._call_all("continue_generation")

    @property
    def flush_with_update(self) -> bool:
        """An in_place pause keeps the paused requests and their (now stale) KV: SGLang refuses to flush
        while requests are held, so the cache is kept (the price of in_place)."""
        return not (self.pause and self.pause_mode == PauseMode.in_place)

    def _check_usable(self) -> None:
        if self._spent:
            raise WeightSyncError(self._spent)
        if self.transport is None:
            raise WeightSyncError("not connected: call connect() before push()")
        if self._broken:
            raise WeightSyncError(
                f"the weight-update group is unusable ({self._broken}); close() and connect()"
            )

    def _send_all(
        self,
        named_weights: Iterable[NamedTensor],
        version: str | None,
        stats: SyncStats,
        record_checksums: bool,
        opening: list[tuple[Any, cf.Future]] | None,
    ) -> None:
        """Pull buckets from the pipeline and send each; the weight version rides on the last one. A
        non-finite tensor stops the push before the bucket carrying it is sent (`FiniteGuard`)."""
        guard = FiniteGuard()
        buckets = wire_buckets(guard.watch(named_weights), self.wire_format, self.cfg.bucket_bytes)
        mark = time.monotonic()
        current = next(buckets, None)
        if current is None:
            raise WeightSyncError("push() got no tensors")
        while current is not None:
            following = next(buckets, None)
            guard.check(version)  # every tensor of `current` was watched (and of `following`)
            if self.load_format == FLATTENED_BUCKET:
                current = sort_for_flattening(current)
            if record_checksums:
                stats.checksums.update(checksums(dict(current)))
            stats.pipeline_seconds += time.monotonic() - mark
            what = f"bucket {stats.buckets} ({len(current)} tensors from {current[0][0]})"
            if opening is not None:  # the session must be open before any bucket (counted as control)
                self._answers(OPEN_SESSION, opening)
                opening = None
            with self.bucket_lock:
                mark = time.monotonic()
                last = following is None and version is not None
                stats.bytes += self.transport.send(
                    current, version if last else None, what, flush_cache=last and self.flush_with_update
                )
                stats.transfer_seconds += time.monotonic() - mark
            stats.buckets += 1
            stats.tensors += len(current)
            current, mark = following, time.monotonic()

    # ------------------------------------------------------------------------------------------ close
    def close(self) -> None:
        """Close the transport (the broadcast group on the engines and here), and stop the HTTP thread;
        safe to call twice. Spent engines stay spent."""
        with self._lock:
            transport, self.transport, self._broken = self.transport, None, None
            if transport is not None:
                transport.close()
            if self._http is not None:
                http, self._http = self._http, None
                http.stop([c.aclose() for c in self.clients if hasattr(c, "aclose")])

    def __enter__(self) -> WeightSync:
        self.connect()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
