"""The trainer side of a weight sync as a pipeline: named weights -> native names -> wire format -> buckets.

Each stage is a generator, so a 284 B-parameter model streams through one tensor at a time (the
trainer gathers, renames, quantizes and sends bucket by bucket; nothing holds the whole model twice):

    trainer weights (transformers names, trainer dtype)
      -> `native_names`   DeepSeek checkpoint names, routed experts split per expert (views, no copies)
      -> `encode`         the wire format of the quant mode: casts, FP8 blocks, MXFP4 + `.scale` units
      -> `iter_buckets`   bounded update requests, quantized pairs and SGLang's fused partners kept whole
    and `WeightSync.push` hands each bucket to its transport.

`FiniteGuard` watches the trainer's tensors on their way in and refuses a NaN or Inf before the bucket that
would carry it is sent (`NonFiniteWeight`, naming the tensor). The trainer loop checks its weights before a
sync already (`dsv4rl.train.nonfinite`); this is the check every sender makes on what it actually sends.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from dsv4rl.faults.nonfinite import finite_flag
from dsv4rl.model.naming import UnknownTensorName, hf_to_native
from dsv4rl.model.wire_format import WireFormat
from dsv4rl.sync.buckets import iter_buckets
from dsv4rl.sync.errors import NonFiniteWeight
from dsv4rl.wire.layout import NamedTensor

__all__ = ["FiniteGuard", "encode", "native_names", "wire_buckets"]


class FiniteGuard:
    """Refuses non-finite tensors of one sync. `watch` queues each floating tensor's check as the pipeline
    pulls it (a kernel, no device sync, no reference kept to the tensor); `check` reads the queued results
    before a bucket is sent: one device sync per bucket."""

    def __init__(self) -> None:
        self._pending: list[tuple[str, Tensor]] = []

    def watch(self, named: Iterable[NamedTensor]) -> Iterator[NamedTensor]:
        for name, tensor in named:
            # a DTensor is refused by native_names, before any of its collectives could run here
            if tensor.is_floating_point() and not isinstance(tensor, DTensor):
                self._pending.append((name, finite_flag(tensor)))
            yield name, tensor

    def check(self, version: str | None) -> None:
        """Raise `NonFiniteWeight` naming the first non-finite tensor watched so far (trainer names)."""
        pending, self._pending = self._pending, []
        devices = {flag.device for _, flag in pending}
        if all(bool(torch.stack([f for _, f in pending if f.device == d]).all()) for d in devices):
            return
        name = next(name for name, flag in pending if not bool(flag))
        step = int(version) if version is not None and version.isdigit() else None
        raise NonFiniteWeight(
            step,
            "sync",
            f"weight {name} (NaN or Inf)",
            "the push was refused before the bucket carrying it was sent (buckets before it reached the "
            "engines, which the run must not use: it stops here)",
        )


def native_names(named_weights: Iterable[NamedTensor]) -> Iterator[NamedTensor]:
    """Transformers names to native checkpoint names; names that are not transformers' pass unchanged."""
    for name, tensor in named_weights:
        if isinstance(tensor, DTensor):
            raise ValueError(
                f"{name} is a sharded DTensor: pass full tensors, gathered on every rank first "
                "(TrainerBackend.named_weights_for_sync)"
            )
        try:
            yield from list(hf_to_native(name, tensor))
        except UnknownTensorName:
            yield name, tensor.detach()  # already a native (or SGLang) name: the engine is the judge


def encode(named: Iterable[NamedTensor], wire_format: WireFormat | None) -> Iterator[list[NamedTensor]]:
    """Each tensor in the wire format, as a unit: [tensor] or [quantized weight, its scale]."""
    for name, tensor in named:
        yield [(name, tensor.detach())] if wire_format is None else wire_format.encode(name, tensor.detach())


def wire_buckets(
    named_weights: Iterable[NamedTensor], wire_format: WireFormat | None, bucket_bytes: int
) -> Iterator[list[NamedTensor]]:
    """The whole pipeline: the update requests of one sync, in order."""
    return iter_buckets(encode(native_names(named_weights), wire_format), bucket_bytes)
