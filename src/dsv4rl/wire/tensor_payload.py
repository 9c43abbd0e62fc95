"""The payload of `/update_weights_from_tensor`: tensors handed over by handle, never by value.

SGLang 0.5.23 (`srt/managers/io_struct.py`, UpdateWeightsFromTensorReqInput) takes `serialized_named_tensors`,
one entry per tensor-parallel rank of the engine (rank i reads entry i), each a base64 string of a
`ForkingPickler` dump (`srt/utils/common.py`, MultiprocessingSerializer):
- `load_format` null or "direct": a list of (name, tensor) pairs ("direct" skips the model's name remapping,
  so it wants SGLang's internal parameter names; the reference engine holds native names either way);
- "flattened_bucket": a dict {"flattened_tensor": uint8 buffer, "metadata": [...]}, each entry with
  `name`, `shape`, `dtype`, `start_idx`, `end_idx`, `numel` in bytes of the buffer
  (`srt/weight_sync/tensor_bucket.py`, FlattenedTensorMetadata). SGLang's scheduler reads exactly those
  six attributes, so the trainer sends them as `types.SimpleNamespace`, which SGLang's unpickler allows,
  and needs no SGLang install.

ForkingPickler pickles a tensor's storage as a handle: CUDA tensors as CUDA IPC handles, CPU tensors as
shared memory. torch's default CPU strategy (`file_descriptor`) passes a descriptor through a socket whose
key only the sender's own child processes hold, so a separately started engine cannot open it (it fails
with AuthenticationError); `serialize` pickles under the `file_system` strategy instead, a named segment in
/dev/shm that any local process can map. A segment lives while either side maps it: the sender keeps its
buffer until the engine answered, the engine copies before answering.

A CUDA handle names its device by UUID, not by index, as SGLang's own patched reductions do
(`srt/utils/patch_torch.py`: `_reduce_tensor_modified` on the sending side, `_device_from_maybe_uuid` on the
receiving one; torch's `rebuild_cuda_tensor` takes the device as its 7th argument): a trainer and an engine
whose CUDA_VISIBLE_DEVICES differ number one GPU differently, and an index would rebuild the tensor on
another device or fail.

The engine unpickles with an allow-list (SGLang does the same with its SafeUnpickler): torch's tensor and
storage rebuild functions, dtypes, sizes, plain containers; any other global (code) is refused.
"""

from __future__ import annotations

import base64
import binascii
import collections
import copyreg
import io
import pickle
import threading
import types
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing  # registers torch's tensor reductions with ForkingPickler

from dsv4rl.wire.layout import (
    FLATTENED_BUCKET,
    NamedTensor,
    dtype_name,
    flatten_bucket,
    flattened_offsets,
    unflatten_bucket,
)

__all__ = [
    "DIRECT",
    "LOAD_FORMATS",
    "PayloadError",
    "deserialize",
    "device_uuid",
    "local_device_index",
    "named_tensors",
    "pack_bucket",
    "reduce_tensor_by_device_uuid",
    "serialize",
]

# The storage device's position among torch's rebuild_cuda_tensor arguments (SGLang's
# _REDUCE_TENSOR_ARG_DEVICE_INDEX in srt/utils/patch_torch.py)
CUDA_DEVICE_ARG = 6
DIRECT = "direct"
LOAD_FORMATS = (None, DIRECT, FLATTENED_BUCKET)  # what SGLang 0.5.23 loads without a custom loader
_METADATA_FIELDS = ("name", "shape", "dtype", "start_idx", "end_idx", "numel")
_STRATEGY_LOCK = threading.Lock()
_TORCH_REDUCE_TENSOR = torch.multiprocessing.reductions.reduce_tensor  # what torch registered for tensors


class PayloadError(ValueError):
    """A payload that does not unpickle to what its load_format promises; nothing is loaded."""


@dataclass
class FlattenedTensorMetadata:
    """SGLang's own metadata class (`srt/weight_sync/tensor_bucket.py`), should a trainer pickle it."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


# ------------------------------------------------------------------------------------------- sender
def pack_bucket(
    bucket: Sequence[NamedTensor], load_format: str | None, device: torch.device
) -> tuple[Any, torch.Tensor]:
    """What one engine rank unpickles for `bucket` (ordered by descending itemsize), and the buffer behind
    it, which the caller keeps alive until the engine answered. The tensors are copied once into a fresh
    buffer, so the handles never point at the trainer's live parameters."""
    buffer = flatten_bucket(bucket, device)
    dtypes = [tensor.dtype for _, tensor in bucket]
    shapes = [tuple(tensor.shape) for _, tensor in bucket]
    if load_format == FLATTENED_BUCKET:
        offsets, _ = flattened_offsets(dtypes, shapes)
        metadata = []
        for (name, tensor), start in zip(bucket, offsets, strict=True):
            size = tensor.numel() * tensor.element_size()
            metadata.append(
                types.SimpleNamespace(
                    name=name, shape=tensor.shape, dtype=tensor.dtype,
                    start_idx=start, end_idx=start + size, numel=size,
                )
            )  # fmt: skip
        return {"flattened_tensor": buffer, "metadata": metadata}, buffer
    views = unflatten_bucket(buffer, dtypes, shapes)
    return [(name, view) for (name, _), view in zip(bucket, views, strict=True)], buffer


def serialize(obj: Any) -> str:
    """MultiprocessingSerializer's base64 string: CPU storages shared as named /dev/shm segments, CUDA
    storages as IPC handles whose device is the GPU's UUID."""
    out = io.BytesIO()
    pickler = ForkingPickler(out)
    for kind, reducer in list(pickler.dispatch_table.items()):
        if reducer is _TORCH_REDUCE_TENSOR:  # torch.Tensor, Parameter and the legacy tensor types
            pickler.dispatch_table[kind] = reduce_tensor_by_device_uuid
    with _STRATEGY_LOCK:  # the strategy is process-wide: switched for this dump only
        previous = torch.multiprocessing.get_sharing_strategy()
        torch.multiprocessing.set_sharing_strategy("file_system")
        try:
            pickler.dump(obj)
        finally:
            torch.multiprocessing.set_sharing_strategy(previous)
    return base64.b64encode(out.getvalue()).decode("ascii")


def reduce_tensor_by_device_uuid(tensor: torch.Tensor) -> tuple[Any, tuple]:
    """torch's reduction of `tensor`, with a CUDA storage's device index replaced by the device's UUID."""
    reductions = torch.multiprocessing.reductions
    rebuild, args = reductions.reduce_tensor(tensor)
    if rebuild is reductions.rebuild_cuda_tensor:
        device = args[CUDA_DEVICE_ARG]
        args = (*args[:CUDA_DEVICE_ARG], device_uuid(device), *args[CUDA_DEVICE_ARG + 1 :])
    return rebuild, args


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def local_device_index(device: int | str) -> int:
    """The index, in this process's numbering, of the GPU a handle names (by UUID, or by index)."""
    if isinstance(device, int):
        return device
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == device:
            return index
    raise PayloadError(
        f"the payload's tensors live on GPU {device}, which this process cannot see (CUDA_VISIBLE_DEVICES): "
        "colocated engines must see the trainer's GPUs"
    )


def _rebuild_cuda_tensor(*args: Any) -> torch.Tensor:
    """torch's rebuild_cuda_tensor, after mapping the device UUID to this process's index."""
    args = (*args[:CUDA_DEVICE_ARG], local_device_index(args[CUDA_DEVICE_ARG]), *args[CUDA_DEVICE_ARG + 1 :])
    return torch.multiprocessing.reductions.rebuild_cuda_tensor(*args)


# ------------------------------------------------------------------------------------------- receiver
def _allowed_globals() -> dict[tuple[str, str], Any]:
    reductions = torch.multiprocessing.reductions
    allowed: dict[tuple[str, str], Any] = {
        ("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)
    }
    allowed.update(
        {
            ("torch", "Tensor"): torch.Tensor,
            ("torch", "Size"): torch.Size,
            ("torch", "device"): torch.device,
            ("torch", "UntypedStorage"): torch.UntypedStorage,
            ("torch.storage", "UntypedStorage"): torch.storage.UntypedStorage,
            ("torch.storage", "TypedStorage"): torch.storage.TypedStorage,
            ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
            ("copyreg", "__newobj__"): copyreg.__newobj__,
            ("collections", "OrderedDict"): collections.OrderedDict,
            ("types", "SimpleNamespace"): types.SimpleNamespace,
            ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): FlattenedTensorMetadata,
        }
    )
    for name in (
        "rebuild_tensor", "rebuild_typed_storage", "rebuild_storage_filename", "rebuild_storage_fd",
        "rebuild_storage_empty", "rebuild_meta_tensor",
    ):  # fmt: skip
        if hasattr(reductions, name):
            allowed[("torch.multiprocessing.reductions", name)] = getattr(reductions, name)
    allowed[("torch.multiprocessing.reductions", "rebuild_cuda_tensor")] = _rebuild_cuda_tensor
    return allowed


class _SafeUnpickler(pickle.Unpickler):
    allowed = _allowed_globals()

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise PayloadError(
                f"refused global {module}.{name} in the pickled payload (not a tensor)"
            ) from None


def deserialize(data: str) -> Any:
    """The object behind one `serialized_named_tensors` entry (base64 of a ForkingPickler dump)."""
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as error:
        raise PayloadError(f"not base64: {error}") from None
    try:
        return _SafeUnpickler(io.BytesIO(raw)).load()
    except PayloadError:
        raise
    except Exception as error:  # truncated pickles, handles to memory that is gone, CUDA on a CPU engine
        raise PayloadError(f"cannot unpickle it: {type(error).__name__}: {error}") from None


def named_tensors(obj: Any, load_format: str | None) -> list[NamedTensor]:
    """(name, tensor) pairs of a deserialized payload, checked against what `load_format` promises."""
    if load_format == FLATTENED_BUCKET:
        return _flattened(obj)
    if not isinstance(obj, list | tuple):
        raise PayloadError(
            f"unpickles to {type(obj).__name__}; load_format={load_format!r} wants a list of (name, tensor)"
        )
    pairs = []
    for index, item in enumerate(obj):
        if not (
            isinstance(item, list | tuple)
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], torch.Tensor)
        ):
            raise PayloadError(f"item {index} is not a (name, tensor) pair: {type(item).__name__}")
        pairs.append((item[0], item[1]))
    return pairs


def _flattened(obj: Any) -> list[NamedTensor]:
    if not isinstance(obj, dict) or set(obj) != {"flattened_tensor", "metadata"}:
        keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise PayloadError(f"load_format=flattened_bucket wants {{flattened_tensor, metadata}}, got {keys}")
    buffer, metadata = obj["flattened_tensor"], obj["metadata"]
    if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise PayloadError("flattened_tensor must be a 1-D uint8 tensor")
    if not isinstance(metadata, list):
        raise PayloadError(f"metadata must be a list, got {type(metadata).__name__}")
    pairs = []
    for index, meta in enumerate(metadata):
        missing = [f for f in _METADATA_FIELDS if not hasattr(meta, f)]
        if missing:
            raise PayloadError(f"metadata[{index}] lacks {missing}")
        dtype, shape, start, end = meta.dtype, meta.shape, meta.start_idx, meta.end_idx
        if not isinstance(dtype, torch.dtype) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise PayloadError(f"metadata[{index}] ({meta.name}): bad dtype {dtype!r} or shape {shape!r}")
        size = torch.Size(shape).numel() * dtype.itemsize
        if not (
            isinstance(start, int) and start >= 0 and end == start + size == start + meta.numel
            and end <= buffer.numel() and start % dtype.itemsize == 0
        ):  # fmt: skip
            raise PayloadError(
                f"metadata[{index}] ({meta.name}): bytes [{start}, {end}) of {meta.numel} do not hold "
                f"{dtype_name(dtype)} {list(shape)} ({size} bytes, aligned) inside the "
                f"{buffer.numel()}-byte buffer"
            )
        pairs.append((str(meta.name), buffer[start:end].view(dtype).reshape(shape)))
    return pairs
