"""A bucket on the wire: its request metadata, dtype names, flattened layout, and the tensors it must
keep together.

Pure functions, shared by the trainer (`WeightSync` and its transports) and the engine (`WeightReceiver`,
`HeldWeights`):
- `pair_key` names the tensors that must share a request: a quantized weight and its `.scale` (the
  quantizer emits them as one unit), and the tensors SGLang fuses at load time (wq_a + wkv, compressor
  wkv + wgate, wo_a weight + scale: a half pair fails the call after a partial update).
- `bucket_metadata` is the request body (`names`, bare `dtypes` such as "bfloat16", `shapes`);
  `dtype_name` / `parse_dtype` are the two directions of a dtype string, as SGLang resolves it.
- `flatten_bucket` / `unflatten_bucket` implement `load_format="flattened_bucket"`: the tensors back to
  back as one uint8 buffer, no padding, each offset a multiple of its itemsize (so callers sort with
  `sort_for_flattening`, largest itemsize first).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

__all__ = [
    "FLATTENED_BUCKET",
    "NamedTensor",
    "bucket_metadata",
    "dtype_name",
    "flatten_bucket",
    "flattened_offsets",
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
