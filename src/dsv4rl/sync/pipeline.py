"""The trainer side of a weight sync as a pipeline: named weights -> native names -> wire format -> buckets.

Each stage is a generator, so a 284 B-parameter model streams through one tensor at a time (the
trainer gathers, renames, quantizes and sends bucket by bucket; nothing holds the whole model twice):

    trainer weights (transformers names, trainer dtype)
      -> `native_names`   DeepSeek checkpoint names, routed experts split per expert (views, no copies)
      -> `encode`         the wire format of the quant mode: casts, FP8 blocks, MXFP4 + `.scale` units
      -> `iter_buckets`   bounded update requests, quantized pairs and SGLang's fused partners kept whole
    and `WeightSync.push` hands each bucket to its transport.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from torch.distributed.tensor import DTensor

from dsv4rl.model.naming import UnknownTensorName, hf_to_native
from dsv4rl.model.wire_format import WireFormat
from dsv4rl.sync.buckets import iter_buckets
from dsv4rl.wire.layout import NamedTensor

__all__ = ["encode", "native_names", "wire_buckets"]


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
