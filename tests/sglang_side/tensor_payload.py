"""The colocated payload as SGLang 0.5.23's scheduler opens it: its `MultiprocessingSerializer` (an
allow-listing unpickler), `FlattenedTensorBucket`, and the patched torch reductions that read the device
of a CUDA handle."""

from __future__ import annotations

import json


def open_payloads(path: str) -> dict:
    """{load format: {name: [dtype, shape, bytes]}} for each serialized payload in the JSON file `path`."""
    import torch
    from sglang.srt.utils.common import MultiprocessingSerializer, normalize_serialized_named_tensor_payload
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

    out = {}
    with open(path) as handle:
        entries = json.load(handle)
    for fmt, entry in entries.items():
        obj = MultiprocessingSerializer.deserialize(normalize_serialized_named_tensor_payload(entry))
        if fmt == "flattened_bucket":  # as model_runner's _update_weights_from_flattened_bucket converts it
            meta = [
                FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx,
                                        end_idx=m.end_idx, numel=m.numel)
                for m in obj["metadata"]
            ]  # fmt: skip
            obj = FlattenedTensorBucket(
                flattened_tensor=obj["flattened_tensor"], metadata=meta
            ).reconstruct_tensors()
        out[fmt] = {
            name: [str(t.dtype), list(t.shape), t.contiguous().view(torch.uint8).flatten().tolist()]
            for name, t in obj
        }
    return out


def device_arg(path: str | None) -> dict:
    """The argument SGLang's patched rebuild reads the device from; with a CUDA payload (`path`), its values
    as SGLang's scheduler opens it."""
    from sglang.srt.utils.common import MultiprocessingSerializer, normalize_serialized_named_tensor_payload
    from sglang.srt.utils.patch_torch import _REDUCE_TENSOR_ARG_DEVICE_INDEX, monkey_patch_torch_reductions

    out = {"device_arg": _REDUCE_TENSOR_ARG_DEVICE_INDEX, "values": None}
    if path is not None:
        monkey_patch_torch_reductions()
        with open(path) as handle:
            entry = json.load(handle)
        obj = MultiprocessingSerializer.deserialize(normalize_serialized_named_tensor_payload(entry))
        out["values"] = {name: t.cpu().tolist() for name, t in obj}
    return out
