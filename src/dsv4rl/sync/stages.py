"""The weight sync as every trainer rank sees it: one sender per pipeline stage, rank 0 in control.

Every trainer rank holds a `StagedWeightSync` and calls it collectively. Rank 0 talks to the engines
around the transfer (pause, open the session; then close it, flush, set the version, continue) and
sends stage 0; the source rank of every other stage sends its own stage over its own group at the same
time (`dsv4rl.topology`); the other ranks only take part in gathering their stage's shards.

The stages gather, rename and quantize side by side, but their buckets reach the engines one at a time:
an engine handles one update request at a time, so two senders whose buckets reached two engines in
opposite orders would wait on each other's broadcasts forever. A lock in the trainer's own store
(`StoreLock`, as slime's rollout-engine lock) is held by a sender from a bucket's POST to its last answer.

    rank 0:        begin_update ─┐                               ┌─ finish_update(version)
    every rank:                  agree ─ send or gather ─ gather reports ─┘
    stage s source:                      send(stage s) over group "<name>-pp<s>"

A failure anywhere reaches every rank: a source whose send fails still drains its stage's tensors (its
stage's other ranks are inside the same gathers), then all ranks raise the same WeightSyncError naming
the stage. With a single stage this is `WeightSync.push` on rank 0, with no extra collective.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch.distributed as dist

from dsv4rl.model.wire_format import WireFormat
from dsv4rl.sync.weight_sync import SyncStats, WeightSync, WeightSyncError
from dsv4rl.topology import SyncSource
from dsv4rl.wire.layout import NamedTensor

__all__ = ["StagedWeightSync", "StoreLock", "merge_stats"]

log = logging.getLogger("dsv4rl.sync")


def merge_stats(reports: Sequence[SyncStats]) -> SyncStats:
    """One sync from its senders' reports: sizes and transfer times add up (the engines take one bucket
    at a time); the senders prepared their buckets side by side, so that time is the slowest one's."""
    merged = SyncStats(sources=len(reports))
    if reports:
        merged.transport = reports[0].transport  # every sender of one sync uses the same transport
    for stats in reports:
        merged.bytes += stats.bytes
        merged.buckets += stats.buckets
        merged.tensors += stats.tensors
        merged.transfer_seconds += stats.transfer_seconds
        merged.pipeline_seconds = max(merged.pipeline_seconds, stats.pipeline_seconds)
        merged.checksums.update(stats.checksums)
    return merged


class StoreLock:
    """A mutex in a torch.distributed store (compare-and-set on one key), bounded by `timeout_s`."""

    def __init__(self, store: dist.Store, key: str, owner: str, timeout_s: float) -> None:
        self.store, self.key, self.owner, self.timeout_s = store, key, owner, timeout_s

    def __enter__(self) -> StoreLock:
        deadline = time.monotonic() + self.timeout_s
        while True:
            holder = self.store.compare_set(self.key, "", self.owner).decode()
            if holder == self.owner:
                return self
            if time.monotonic() > deadline:
                raise WeightSyncError(
                    f"{self.owner} waited sync.timeout_s={self.timeout_s:g} s for the engines, held by "
                    f"{holder} all along (a sender stuck in its transfer)"
                )
            time.sleep(0.002)

    def __exit__(self, *exc_info: Any) -> None:
        self.store.compare_set(self.key, self.owner, "")


def _drain(named_weights: Iterable[NamedTensor]) -> None:
    for _ in named_weights:
        pass


class StagedWeightSync:
    """This rank's part in the weight sync. `sender` is its `WeightSync` when it is a stage's source
    (its group named and placed as `sources[stage]` says), else None. Rank 0 must be stage 0's source."""

    def __init__(self, sources: Sequence[SyncSource], rank: int, sender: WeightSync | None) -> None:
        self.sources = list(sources)
        self.rank = rank
        self.sender = sender
        mine = [source for source in self.sources if source.rank == rank]
        if not self.sources or self.sources[0].rank != 0:
            raise ValueError(f"stage 0's weights must leave from rank 0, got sources {self.sources}")
        if bool(mine) != (sender is not None):
            raise ValueError(f"rank {rank} is {'a' if mine else 'no'} stage source but got sender={sender}")
        self.stage: int | None = mine[0].stage if mine else None
        if self.by_stage and sender is not None:
            store = dist.PrefixStore("dsv4rl-weight-sync", dist.distributed_c10d._get_default_store())
            owner = f"stage {self.stage} (rank {rank})"
            sender.bucket_lock = StoreLock(store, "engines", owner, sender.cfg.timeout_s)

    @property
    def by_stage(self) -> bool:
        """Several senders: each stage's source yields its own stage (`named_weights_for_sync(by_stage)`)."""
        return len(self.sources) > 1

    # ------------------------------------------------------------------------------------------ setup
    def connect(self) -> None:
        """Stage by stage: an engine joins one group at a time (SGLang's scheduler blocks inside a join),
        so the groups are built one after another, never side by side."""
        for source in self.sources:
            error = None
            if source.rank == self.rank:
                try:
                    self.sender.connect()
                except WeightSyncError as exc:
                    error = f"stage {source.stage} (rank {source.rank}): {exc}"
            self._agree(error)

    def regroup(self, members: Sequence[int], urls: Sequence[str] | None = None) -> None:
        """Collective: every stage's group rebuilt with the engines `members` (`WeightSync.regroup`, with
        rank 0's engine `urls`), one stage after another as in `connect`."""
        for source in self.sources:
            error = None
            if source.rank == self.rank:
                try:
                    self.sender.regroup(members, urls)
                except WeightSyncError as exc:
                    error = f"stage {source.stage} (rank {source.rank}): rebuilding the group: {exc}"
            self._agree(error)

    def share_wire_format(self, served_format: Callable[[], WireFormat | None] | None) -> None:
        """Rank 0 learns what the engines serve (`served_format`, called there only); every sender then
        encodes to it. A refusal on rank 0 is raised there and, as a WeightSyncError, on every rank."""
        box: list[Any] = [("ok", None)]
        failure: Exception | None = None
        if self.rank == 0:
            try:
                box[0] = ("ok", served_format())
            except Exception as exc:
                failure, box[0] = exc, ("error", f"rank 0: {exc}")
        if self.by_stage:
            dist.broadcast_object_list(box, src=0)
        status, value = box[0]
        if failure is not None:
            raise failure
        if status == "error":
            raise WeightSyncError(value)
        if self.sender is not None:
            self.sender.wire_format = value

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()

    @property
    def spent(self) -> str | None:
        """Why this rank's engines must be restarted before any push (rank 0 knows it for every stage: it
        opens and closes the sessions), or None."""
        return self.sender.spent if self.sender is not None else None

    def engines_replaced(self) -> None:
        """Rank 0: the spent engines were restarted (`WeightSync.engines_replaced`)."""
        if self.sender is not None:
            self.sender.engines_replaced()

    # ------------------------------------------------------------------------------------------ push
    def push(
        self, named_weights: Iterable[NamedTensor], version: str, *, record_checksums: bool = False
    ) -> SyncStats | None:
        """Collective: every rank passes its `named_weights_for_sync(by_stage=self.by_stage)`. Rank 0
        gets the sync's stats (checksums of every stage when recorded); the other ranks get None."""
        if not self.by_stage:
            if self.sender is None:
                _drain(named_weights)
                return None
            return self.sender.push(named_weights, version, record_checksums=record_checksums)
        start = time.monotonic()
        error = None
        if self.rank == 0:
            try:
                self.sender.begin_update()
            except WeightSyncError as exc:
                error = f"opening the weight-update session: {exc}"
        self._agree(error)  # no source POSTs a bucket before the engines' session is open
        stats, error = None, None
        if self.sender is None:
            _drain(named_weights)
        else:
            try:  # the version is set once, after every stage arrived
                stats = self.sender.send(named_weights, None, record_checksums=record_checksums)
            except WeightSyncError as exc:
                error = f"stage {self.stage} (rank {self.rank}): {exc}"
                _drain(named_weights)
        reports: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(reports, (error, stats))
        errors = [report[0] for report in reports if report[0]]
        if errors:
            if self.rank == 0:
                self.sender.abandon_update()
            spent = f"\n{self.sender.spent}" if self.sender is not None and self.sender.spent else ""
            raise WeightSyncError("weight sync failed: " + "; ".join(errors) + spent)
        if self.rank != 0:
            return None
        self.sender.close_session(version)
        merged = merge_stats([report[1] for report in reports if report[1] is not None])
        merged.seconds = time.monotonic() - start
        log.info(
            "weights %s pushed from %d stages: %d tensors in %d buckets, %.1f MB in %.2f s (%.3f GB/s)",
            *(version, len(self.sources), merged.tensors, merged.buckets, merged.bytes / 1e6),
            *(merged.seconds, merged.gb_per_s),
        )
        return merged

    def _agree(self, error: str | None) -> None:
        """Every rank learns whether any rank failed; all raise the same error when one did."""
        if not self.by_stage:
            if error:
                raise WeightSyncError(error)
            return
        errors: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        failed = [e for e in errors if e]
        if failed:
            raise WeightSyncError("; ".join(failed))
