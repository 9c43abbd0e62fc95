"""Split a weight stream into update requests ("buckets") and pack them for the wire.

Pure functions, shared by the trainer (`WeightSync`) and the engine (`WeightReceiver`):
- `iter_buckets` bounds each `/update_weights_from_distributed` request to `bucket_bytes` (the server
  allocates every tensor of a request at once), while keeping together what must share a request: a
  quantized weight and its `.scale` (the quantizer emits them as one unit), and the tensors SGLang fuses
  at load time (wq_a + wkv, compressor wkv + wgate, wo_a weight + scale: a half pair fails the call after
  a partial update).
- `bucket_metadata` is the request body (`names`, bare `dtypes` such as "bfloat16", `shapes`).
- `flatten_bucket` / `unflatten_bucket` implement `load_format="flattened_bucket"`: the tensors back to
  back as one uint8 buffer, no padding, each offset a multiple of its itemsize (so callers sort with
  `sort_for_flattening`, largest itemsize first).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence

import torch

__all__ = [
    "FLATTENED_BUCKET",
    "NamedTensor",
    "bucket_metadata",
    "dtype_name",
    "flatten_bucket",
    "flattened_offsets",
    "iter_buckets",
    "pair_key",
    "parse_dtype",
    "sort_for_flattening",
    "unflatten_bucket",
]

FLATTENED_BUCKET = "flattened_bucket"
NamedTensor = tuple[str, torch.Tensor]

# Tensors SGLang fuses while loading; each match gives (bundle key, member kind, suffix).
# Native names (`attn.`), SGLang names (`self_attn.`, `.weight_scale_inv`) and transformers names
# (`q_a_proj`, `kv_proj`, `gate_proj`) are all covered.
_SUFFIX = r"(weight|scale|weight_scale_inv)"
_PAIR_RULES: tuple[tuple[re.Pattern[str], str], ...] = (
    # wq_a + wkv -> wqkv_a (weights and scales), while SGLANG_OPT_FUSE_WQA_WKV=1 (default)
    (re.compile(rf"^(.*\.(?:attn|self_attn))\.(wq_a|wkv|q_a_proj|kv_proj)\.{_SUFFIX}$"), "wqkv_a"),
    # compressor.wkv + compressor.wgate -> wkv_gate (also the indexer's compressor)
    (re.compile(rf"^(.*\.compressor)\.(wkv|wgate|kv_proj|gate_proj)\.{_SUFFIX}$"), "wkv_gate"),
    (re.compile(rf"^(.*\.compressor\.indexer)\.(kv_proj|gate_proj)\.{_SUFFIX}$"), "wkv_gate"),
    # wo_a.weight + wo_a.scale are dequantised together when SGLang keeps wo_a in BF16
    (re.compile(r"^(.*\.wo_a)\.(weight|scale)()$"), "wo_a"),
)
_KIND_ALIASES = {"q_a_proj": "wq_a", "kv_proj": "wkv", "gate_proj": "wgate", "weight_scale_inv": "scale"}
_LAYER = re.compile(r"^((?:model\.)?(?:layers|mtp)\.\d+\.)")


def pair_key(name: str) -> tuple[str, str, str] | None:
    """(bundle key, member kind, suffix) if `name` must travel with partners, else None."""
    for pattern, fused in _PAIR_RULES:
        match = pattern.match(name)
        if match:
            prefix, kind, suffix = match.groups()
            kind, suffix = _KIND_ALIASES.get(kind, kind), _KIND_ALIASES.get(suffix, suffix)
            if fused == "wo_a":  # one module: the members are its weight and its scale
                return prefix, kind, ""
            return f"{prefix}.{fused}", kind, suffix
    return None


def _layer_of(name: str) -> str:
    match = _LAYER.match(name)
    return match.group(1) if match else ""


class _Bundle:
    """Partners collected so far; complete when every member kind has the same non-empty suffix set."""

    def __init__(self, key: str, layer: str, wo_a: bool) -> None:
        self.key, self.layer, self.wo_a = key, layer, wo_a
        self.items: list[NamedTensor] = []
        self.members: dict[str, set[str]] = {}

    def add(self, item: NamedTensor, kind: str, suffix: str) -> None:
        self.items.append(item)
        self.members.setdefault(kind, set()).add(suffix)

    def complete(self) -> bool:
        if self.wo_a:
            return {"weight", "scale"} <= self.members.keys()
        if len(self.members) < 2:
            return False
        suffixes = list(self.members.values())
        return all(s == suffixes[0] for s in suffixes)


def _units(stream: Iterable[NamedTensor | list[NamedTensor]]) -> Iterator[list[NamedTensor]]:
    """Group the stream into units that must share a bucket, keeping the stream order otherwise.

    Items are single (name, tensor) pairs or lists that already form a unit (a weight and its scale).
    An incomplete bundle (e.g. an unquantised wo_a without scale) is released when the stream moves on
    to another layer, so at most about one layer's tensors are held back.
    """
    pending: dict[str, _Bundle] = {}
    for item in stream:
        unit = item if isinstance(item, list) else [item]
        if not unit:
            continue
        layer = _layer_of(unit[0][0])
        for key in [k for k, b in pending.items() if b.layer != layer]:
            yield pending.pop(key).items
        paired = [(member, pair_key(member[0])) for member in unit]
        keys = {p[0] for _, p in paired if p is not None}
        if not keys:
            yield unit
            continue
        key = keys.pop() if len(keys) == 1 else ",".join(sorted(keys))
        bundle = pending.setdefault(key, _Bundle(key, layer, wo_a=key.endswith(".wo_a")))
        for member, pair in paired:
            if pair is None:
                bundle.items.append(member)
            else:
                bundle.add(member, pair[1], pair[2])
        if bundle.complete():
            yield pending.pop(key).items
    for bundle in pending.values():
        yield bundle.items


def iter_buckets(
    stream: Iterable[NamedTensor | list[NamedTensor]], bucket_bytes: int
) -> Iterator[list[NamedTensor]]:
    """Buckets of at most `bucket_bytes` (a unit larger than that travels alone), units and pairs kept whole.

    `stream` yields (name, tensor) pairs, or lists of them that must travel together.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: list[NamedTensor] = []
    size = 0
    for unit in _units(stream):
        unit_bytes = sum(t.numel() * t.element_size() for _, t in unit)
        if bucket and size + unit_bytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.extend(unit)
        size += unit_bytes
    if bucket:
        yield bucket


def dtype_name(dtype: torch.dtype) -> str:
    """The bare name SGLang resolves with getattr(torch, name): torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """Resolve a wire dtype string exactly as SGLang does, refusing what SGLang would choke on."""
    if not isinstance(name, str) or not name or name.startswith("torch."):
        raise ValueError(
            f"bad dtype string {name!r}: use the bare torch name, "
            "e.g. 'bfloat16' or 'int64' (not 'torch.int64')"
        )
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"bad dtype string {name!r}: torch has no dtype of that name")
    return dtype


def bucket_metadata(bucket: Sequence[NamedTensor]) -> dict[str, list]:
    """The `/update_weights_from_distributed` body fields for `bucket`, in broadcast order."""
    return {
        "names": [name for name, _ in bucket],
        "dtypes": [dtype_name(t.dtype) for _, t in bucket],
        "shapes": [list(t.shape) for _, t in bucket],
    }


def sort_for_flattening(bucket: Sequence[NamedTensor]) -> list[NamedTensor]:
    """Descending itemsize (stable): every offset in the flat buffer is then aligned for its dtype."""
    return sorted(bucket, key=lambda item: -item[1].element_size())


def flattened_offsets(
    dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]
) -> tuple[list[int], int]:
    """Byte offset of each tensor in a flattened bucket and the total size; ValueError if unaligned."""
    offsets, offset = [], 0
    for index, (dtype, shape) in enumerate(zip(dtypes, shapes, strict=True)):
        itemsize = torch.empty((), dtype=dtype).element_size()
        if offset % itemsize:
            raise ValueError(
                f"Unaligned received tensor #{index} ({dtype_name(dtype)}) at byte offset {offset}: "
                "order a flattened bucket by descending itemsize"
            )
        offsets.append(offset)
        numel = 1
        for dim in shape:
            numel *= int(dim)
        offset += numel * itemsize
    return offsets, offset


def flatten_bucket(bucket: Sequence[NamedTensor], device: torch.device | str | None = None) -> torch.Tensor:
    """One uint8 buffer holding the tensors of `bucket` back to back, in order (no padding)."""
    tensors = [t.detach() for _, t in bucket]
    flattened_offsets([t.dtype for t in tensors], [t.shape for t in tensors])  # alignment check
    device = torch.device(device) if device is not None else (tensors[0].device if tensors else "cpu")
    parts = [t.to(device).contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)


def unflatten_bucket(
    buffer: torch.Tensor, dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]
) -> list[torch.Tensor]:
    """Views into `buffer` (uint8) for each tensor of a flattened bucket."""
    offsets, total = flattened_offsets(dtypes, shapes)
    if buffer.dtype != torch.uint8 or buffer.numel() != total:
        raise ValueError(
            f"flattened bucket holds {buffer.numel()} {buffer.dtype} elements, expected {total} uint8"
        )
    out = []
    for offset, dtype, shape in zip(offsets, dtypes, shapes, strict=True):
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = 1
        for dim in shape:
            numel *= int(dim)
        out.append(buffer[offset : offset + numel * itemsize].view(dtype).view(*shape))
    return out
