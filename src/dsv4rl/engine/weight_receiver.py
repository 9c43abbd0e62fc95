"""The engine side of checkpoint-free weight sync (sglang-contract.md §5.2), for one TP rank.

`WeightReceiver` joins the trainer's process group on `/init_weights_update_group` and, on each
`/update_weights_from_distributed`, receives every tensor of the request by broadcast from rank 0 (the
trainer), in `names` order, then copies them into the model (parameters and persistent buffers such as
`tid2eid` and `e_score_correction_bias`).

Unlike SGLang, every check runs BEFORE any broadcast is joined: a bad dtype string, an unknown name, a
shape or integer/float mismatch, an unaligned flattened bucket or a half of a fused pair is a ValueError
(HTTP 400) and nothing is received, so the trainer sees a fast failure rather than a hang on SGLang.
Loading happens only after the whole request arrived, so a failed transfer leaves the model untouched.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dsv4rl.model.naming import UnknownTensorName, native_slot, slot_view
from dsv4rl.sync.buckets import FLATTENED_BUCKET, flattened_offsets, pair_key, parse_dtype, unflatten_bucket
from dsv4rl.sync.process_group import (
    BACKENDS,
    destroy_custom_process_group,
    format_init_method,
    init_custom_process_group,
)

__all__ = ["WeightReceiver"]

# Bounds the rendezvous and each broadcast (a trainer that dies mid-transfer); SGLang uses torch's 30 min.
TIMEOUT_ENV = "DSV4RL_WEIGHT_SYNC_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class _Planned:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    target: torch.Tensor  # a view into the model's parameter or buffer


def _category(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "float" if dtype.is_floating_point else "integer"


class WeightReceiver:
    """Receives weight updates for `model` over named custom process groups (one TP rank: tp_rank 0).

    `timeout_s` bounds the rendezvous and each broadcast; default: $DSV4RL_WEIGHT_SYNC_TIMEOUT_S or 1800.
    """

    def __init__(self, model: torch.nn.Module, *, timeout_s: float | None = None) -> None:
        self.model = model
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
            device = self._device(backend)
            if load_format == FLATTENED_BUCKET:
                _, total = flattened_offsets([p.dtype for p in plan], [p.shape for p in plan])
                buffer = torch.empty(total, dtype=torch.uint8, device=device)
                dist.broadcast(buffer, src=0, group=pg)
                received = unflatten_bucket(buffer, [p.dtype for p in plan], [p.shape for p in plan])
            else:
                received = [torch.empty(p.shape, dtype=p.dtype, device=device) for p in plan]
                works = [dist.broadcast(t, src=0, group=pg, async_op=True) for t in received]
                for work in works:
                    work.wait()
            with torch.no_grad():
                for planned, tensor in zip(plan, received, strict=True):
                    planned.target.copy_(tensor)

    def plan(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        load_format: str | None = None,
    ) -> list[_Planned]:
        """Every check of a request, without touching the network; ValueError names the first problem."""
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(
                f"names ({len(names)}), dtypes ({len(dtypes)}) and shapes ({len(shapes)}) "
                "must have the same length"
            )
        if not names:
            raise ValueError("the request names no tensors")
        # Like SGLang, any load_format other than "flattened_bucket" takes the per-tensor path.
        duplicates = sorted(n for n, count in Counter(names).items() if count > 1)
        if duplicates:
            raise ValueError(f"tensor names repeat within one request: {duplicates[:5]}")
        state = self.model.state_dict(keep_vars=True)
        plan = []
        for name, dtype_str, shape in zip(names, dtypes, shapes, strict=True):
            try:
                dtype = parse_dtype(dtype_str)
            except ValueError as error:
                raise ValueError(f"{name}: {error}") from None
            if not all(isinstance(d, int) and d >= 0 for d in shape):
                raise ValueError(f"{name}: shape {list(shape)} must be a list of non-negative integers")
            target = self._target(state, name)
            if tuple(shape) != tuple(target.shape):
                raise ValueError(
                    f"{name}: shape {list(shape)} does not match the model's {list(target.shape)}"
                )
            if _category(dtype) != _category(target.dtype):
                raise ValueError(
                    f"{name}: dtype {dtype_str} cannot be loaded into the model's {target.dtype} "
                    f"({_category(dtype)} vs {_category(target.dtype)}; integer tables such as tid2eid must "
                    "be sent as integers, never through a float cast)"
                )
            plan.append(_Planned(name, dtype, tuple(shape), target))
        _check_pairs(names)
        if load_format == FLATTENED_BUCKET:
            flattened_offsets([p.dtype for p in plan], [p.shape for p in plan])
        return plan

    @staticmethod
    def _target(state: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
        if name in state:  # a transformers name
            return state[name]
        try:
            return slot_view(state, native_slot(name))
        except UnknownTensorName as error:
            raise ValueError(
                f"unknown tensor name {name!r}: neither a native DeepSeek-V4 checkpoint name of this model "
                f"nor one of its transformers state-dict names ({error.args[0]})"
            ) from None

    def _device(self, backend: str) -> torch.device:
        if backend == "gloo":
            return torch.device("cpu")
        for tensor in self.model.parameters():
            if tensor.is_cuda:
                return tensor.device
        return torch.device("cuda", torch.cuda.current_device())


def _check_pairs(names: Sequence[str]) -> None:
    """SGLang fuses wq_a+wkv and compressor wkv+wgate at load: a request must carry both halves."""
    members: dict[str, dict[str, set[str]]] = {}
    for name in names:
        paired = pair_key(name)
        if paired is not None and not paired[0].endswith(".wo_a"):  # wo_a's scale is optional
            key, kind, suffix = paired
            members.setdefault(key, {}).setdefault(kind, set()).add(suffix)
    for key, kinds in members.items():
        suffixes = list(kinds.values())
        if len(kinds) < 2 or any(s != suffixes[0] for s in suffixes):
            have = {kind: sorted(s) for kind, s in kinds.items()}
            raise ValueError(
                f"half of a fused pair in one request: {key} has {have}; SGLang fuses these at load time, so "
                "send both halves (weight and scale alike) in the same request"
            )
