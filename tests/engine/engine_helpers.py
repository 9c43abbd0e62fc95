"""Helpers for the engine tests (a unique module name: tests/ is not a package)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


class RecordingReceiver:
    """Stands in for dsv4rl.engine.weight_receiver.WeightReceiver: records every call."""

    def __init__(self, fail_with: Exception | None = None) -> None:
        self.calls: list[tuple[str, tuple]] = []
        self.groups: set[str] = set()
        self.fail_with = fail_with

    def init_group(self, master_address, master_port, rank_offset, world_size, group_name, backend) -> None:
        self.calls.append(
            ("init_group", (master_address, master_port, rank_offset, world_size, group_name, backend))
        )
        self.groups.add(group_name)

    def receive(self, names, dtypes, shapes, group_name, load_format=None) -> None:
        self.calls.append(("receive", (names, dtypes, shapes, group_name, load_format)))
        if self.fail_with is not None:
            raise self.fail_with

    def destroy_group(self, group_name: str) -> None:
        self.calls.append(("destroy_group", (group_name,)))
        self.groups.discard(group_name)

    def has_group(self, group_name: str) -> bool:
        return group_name in self.groups


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict]:
    """Run fn in a thread; the returned dict gets its result under "value"."""
    box: dict = {}

    def run() -> None:
        box["value"] = fn()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


def tensor_update(tensors: dict, load_format: str | None = None) -> tuple[str, Any]:
    """One `serialized_named_tensors` entry for `tensors` (as the trainer's TensorTransport builds it) and
    the buffer it points at, which must stay alive until the engine answered."""
    import torch

    from dsv4rl.wire.layout import sort_for_flattening
    from dsv4rl.wire.tensor_payload import pack_bucket, serialize

    bucket = sort_for_flattening(list(tensors.items()))
    payload, buffer = pack_bucket(bucket, load_format, torch.device("cpu"))
    return serialize(payload), buffer


def changed_weights(held: dict) -> dict:
    """Every held tensor with other values (floats + 0.5, integers shifted; FP8/E8M0 bytes flipped)."""
    import torch

    out = {}
    for name, tensor in held.items():
        if tensor.dtype in (torch.float32, torch.bfloat16, torch.float16):
            out[name] = tensor + 0.5
        elif tensor.element_size() == 1:
            out[name] = (tensor.view(torch.uint8) ^ 1).view(tensor.dtype)
        else:
            out[name] = (tensor + 1) % max(int(tensor.max()) + 1, 2)
    return out
