"""The engine side of checkpoint-free weight sync, for one TP rank.

`WeightReceiver` joins the trainer's process group on `/init_weights_update_group` and, on each
`/update_weights_from_distributed`, receives every tensor of the request by broadcast from rank 0 (the
trainer), in `names` order, into the engine's `HeldWeights`.

Unlike SGLang, every check runs BEFORE any broadcast is joined (`HeldWeights.plan`: names, exact dtypes
and shapes, weight/scale and fused pairs; plus the flattened-bucket alignment), so a wrong request is a
ValueError (HTTP 400) with nothing received, and the trainer sees a fast failure rather than a hang or a
half-written model. Writing happens only after the whole request arrived.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

import torch
import torch.distributed as dist

from dsv4rl.engine.weight_store import HeldWeights, PlannedTensor
from dsv4rl.faults import heartbeat
from dsv4rl.wire.layout import FLATTENED_BUCKET, flattened_offsets, unflatten_bucket
from dsv4rl.wire.process_group import (
    BACKENDS,
    destroy_custom_process_group,
    format_init_method,
    init_custom_process_group,
    transport_view,
)

__all__ = ["WeightReceiver"]

# Bounds the rendezvous and each broadcast (a trainer that dies mid-transfer); SGLang uses torch's 30 min.
TIMEOUT_ENV = "DSV4RL_WEIGHT_SYNC_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 1800.0


class WeightReceiver:
    """Receives weight updates into `held` over named custom process groups (one TP rank: tp_rank 0).

    `timeout_s` bounds the rendezvous and each broadcast; default: $DSV4RL_WEIGHT_SYNC_TIMEOUT_S or 1800.
    `device` is where NCCL receives (default: the current CUDA device); gloo receives on the CPU.
    """

    def __init__(
        self, held: HeldWeights, *, timeout_s: float | None = None, device: torch.device | None = None
    ) -> None:
        self.held = held
        self.device = device
        if timeout_s is None:
            timeout_s = float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
        self.timeout_s = float(timeout_s)
        self._groups: dict[str, tuple[dist.ProcessGroup, str]] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------------------ groups
    def has_group(self, group_name: str) -> bool:
        return group_name in self._groups

    def init_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        """Join the trainer's group as rank `rank_offset` (+ tp_rank 0); blocks until every rank joined."""
        backend = str(backend).lower()
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose from {list(BACKENDS)}")
        if not 0 < int(master_port) < 65536:
            raise ValueError(f"master_port must be in 1..65535, got {master_port}")
        if world_size < 2:
            raise ValueError(
                f"world_size must be at least 2 (the trainer plus this engine), got {world_size}"
            )
        if not 1 <= rank_offset < world_size:
            raise ValueError(
                f"rank_offset {rank_offset} must be in 1..{world_size - 1} (rank 0 is the trainer)"
            )
        with self._lock:
            if group_name in self._groups:
                raise ValueError(
                    f"a weight-update group named {group_name!r} already exists; destroy it first "
                    "(/destroy_weights_update_group)"
                )
            pg = init_custom_process_group(
                backend,
                format_init_method(master_address, int(master_port)),
                world_size=world_size,
                rank=rank_offset,
                group_name=group_name,
                timeout=self.timeout_s,
            )
            self._groups[group_name] = (pg, backend)

    def destroy_group(self, group_name: str) -> None:
        with self._lock:
            if group_name not in self._groups:
                raise ValueError(f"The group to be destroyed does not exist: {group_name!r}")
            pg, _ = self._groups.pop(group_name)
            destroy_custom_process_group(pg)

    # ------------------------------------------------------------------------------------------ receive
    def receive(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        load_format: str | None = None,
    ) -> None:
        """Validate the request, receive each tensor by broadcast from rank 0, then load them all."""
        with self._lock:
            if group_name not in self._groups:
                known = sorted(self._groups) or "none"
                raise ValueError(
                    f"no weight-update group named {group_name!r} (known: {known}); "
                    "call /init_weights_update_group first"
                )
            pg, backend = self._groups[group_name]
            plan = self.plan(names, dtypes, shapes, load_format)
            device = torch.device("cpu") if backend == "gloo" else self._cuda_device()
            if load_format == FLATTENED_BUCKET:
                _, total = flattened_offsets([p.dtype for p in plan], [p.shape for p in plan])
                buffer = torch.empty(total, dtype=torch.uint8, device=device)
                work = dist.broadcast(buffer, src=0, group=pg, async_op=True)
                heartbeat.reached("weight_broadcast")  # tensors in flight: a test's fault point
                work.wait()
                received = unflatten_bucket(buffer, [p.dtype for p in plan], [p.shape for p in plan])
            else:
                received = [torch.empty(p.shape, dtype=p.dtype, device=device) for p in plan]
                works = [
                    dist.broadcast(transport_view(t, backend), src=0, group=pg, async_op=True)
                    for t in received
                ]
                heartbeat.reached("weight_broadcast")
                for work in works:
                    work.wait()
            self.held.commit({p.name: tensor for p, tensor in zip(plan, received, strict=True)})

    def plan(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        load_format: str | None = None,
    ) -> list[PlannedTensor]:
        """Every check of a request, without touching the network; ValueError names the first problem."""
        plan = self.held.plan(names, dtypes, shapes)
        # Like SGLang, any load_format other than "flattened_bucket" takes the per-tensor path.
        if load_format == FLATTENED_BUCKET:
            flattened_offsets([p.dtype for p in plan], [p.shape for p in plan])
        return plan

    def _cuda_device(self) -> torch.device:
        return self.device if self.device is not None else torch.device("cuda", torch.cuda.current_device())
