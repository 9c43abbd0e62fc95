"""A process group outside torch's default group: the trainer <-> engines weight-update group.

This mirrors SGLang 0.5.23's `init_custom_process_group` (`srt/utils/common.py`) so the trainer side joins
exactly the group an SGLang server creates: a TCPStore on `tcp://host:port` hosted by rank 0, wrapped in
`PrefixStore(group_name, store)`, and a group built by torch's `_new_process_group_helper` with an
empty rank list. The helper does not touch the default group, so it works in an engine process
(no default group) and in a torchrun trainer rank (default group already set up for FSDP).

Two deliberate differences from a plain `rendezvous()` call:
- The TCPStore is created directly. Under torchrun `TORCHELASTIC_USE_AGENT_STORE=True` makes
  `rendezvous()` connect to the elastic agent's store instead of hosting one, so rank 0 of this
  group would wait for a server that never starts.
- If the default group is NCCL with a bound device, torch would try to split the new communicator
  from it (`ncclCommSplit`); this group has other members, so that split is switched off.
"""

from __future__ import annotations

import ipaddress
import threading
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore
from torch.distributed.distributed_c10d import (
    Backend,
    ProcessGroup,
    _new_process_group_helper,
    _world,
)

__all__ = [
    "BACKENDS",
    "destroy_custom_process_group",
    "format_init_method",
    "init_custom_process_group",
    "transport_view",
]

BACKENDS = ("gloo", "nccl")
DEFAULT_TIMEOUT = timedelta(minutes=30)  # torch's default_pg_timeout, what SGLang uses
_lock = threading.Lock()


_BYTE_VIEWED = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu)


def transport_view(tensor: torch.Tensor, backend: str) -> torch.Tensor:
    """The tensor a broadcast moves: gloo has no float8 types, so those travel as their bytes (uint8).

    Both ends of a gloo group apply the same view; the bytes, and so the received tensor, are identical.
    NCCL broadcasts float8 tensors as they are (what SGLang's receiver posts).
    """
    if backend == "gloo" and tensor.dtype in _BYTE_VIEWED:
        return tensor.view(torch.uint8)
    return tensor


def format_init_method(host: str, port: int) -> str:
    """`tcp://host:port`, with IPv6 literals bracketed (`tcp://[::1]:29600`)."""
    bare = host.strip("[]")
    try:
        is_v6 = ipaddress.ip_address(bare).version == 6
    except ValueError:
        is_v6 = False
    return f"tcp://[{bare}]:{port}" if is_v6 else f"tcp://{host}:{port}"


def _parse_tcp(init_method: str) -> tuple[str, int]:
    url = urlparse(init_method)
    if url.scheme != "tcp" or url.hostname is None or url.port is None:
        raise ValueError(
            f"init_method must look like tcp://host:port (IPv6: tcp://[::1]:port), got {init_method!r}"
        )
    return url.hostname, url.port


def _check_backend(backend: str) -> str:
    name = str(backend).lower()
    if name not in BACKENDS:
        raise ValueError(f"unknown weight-update backend {backend!r}; choose from {list(BACKENDS)}")
    if name == "nccl" and not dist.is_nccl_available():
        raise ValueError("backend 'nccl' needs a CUDA/ROCm build of torch with NCCL/RCCL; use 'gloo' on CPU")
    if name == "gloo" and not dist.is_gloo_available():
        raise ValueError("backend 'gloo' is not available in this torch build")
    return name


def init_custom_process_group(
    backend: str,
    init_method: str,
    world_size: int,
    rank: int,
    group_name: str,
    timeout: timedelta | float | None = None,
) -> ProcessGroup:
    """Join (rank 0: host) the group `group_name`; blocks until all `world_size` ranks have joined.

    `timeout` (timedelta or seconds) bounds the rendezvous and every collective on the group (gloo
    raises, NCCL's watchdog aborts), so a peer that never shows up fails the call instead of hanging.
    """
    name = _check_backend(backend)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the group of world_size {world_size}")
    if isinstance(timeout, int | float):
        timeout = timedelta(seconds=float(timeout))
    timeout = timeout or DEFAULT_TIMEOUT
    host, port = _parse_tcp(init_method)
    if group_name in _world.pg_names.values():
        raise ValueError(
            f"a process group named {group_name!r} already exists in this process; destroy it first"
        )

    store = TCPStore(
        host_name=host,
        port=port,
        world_size=world_size,
        is_master=rank == 0,
        timeout=timeout,
        multi_tenant=True,
    )
    store = PrefixStore(group_name, store)

    with _lock:
        default = _world.default_pg
        bound = default.bound_device_id if default is not None else None
        if bound is not None:
            default.bound_device_id = None  # no ncclCommSplit from the trainer's own group
        try:
            pg, _ = _new_process_group_helper(
                world_size,
                rank,
                [],
                Backend(name),
                store,
                group_name=group_name,
                timeout=timeout,
            )
        finally:
            if bound is not None:
                default.bound_device_id = bound
        # Ranks of this group are its own: "global" rank i is group rank i (src=0 is the trainer).
        _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_custom_process_group(pg: ProcessGroup | None) -> None:
    """Tear down a group made by `init_custom_process_group`; leaves the default group alone.

    Drop every reference to `pg` afterwards: a shut-down gloo group that is still alive at interpreter
    exit can abort the process ("terminate called without an active exception", torch 2.13).
    """
    if pg is None or pg not in _world.pg_map:
        return
    with _lock:
        dist.destroy_process_group(pg)
