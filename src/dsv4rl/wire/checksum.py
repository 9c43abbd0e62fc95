"""Per-tensor checksums both ends of a weight sync can compute: what the trainer sent, what an engine holds.

The reference engine's `/weights_checker` answers with these over the tensors it holds, under the
checkpoint's native names and in their held dtypes (FP8 bytes and scales included), so the trainer can
compare them with the same digests of what it sent, bit for bit. A real SGLang engine cannot: its
checksums cover its internal parameter names (fused `wqkv_a`, `w13_weight`, ...) and hash the
dequantized values with its own 64-bit `tensor_hash`; use the log-prob probe there. The per-rank and
per-engine digests are computed as SGLang computes them from the per-tensor strings.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import torch


def tensor_sha256(tensor: torch.Tensor) -> str:
    """Digest of the raw bytes of `tensor` (contiguous, CPU), so any dtype including fp8 works."""
    data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


def checksums(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """{name: sha256} of named tensors."""
    return {name: tensor_sha256(tensor) for name, tensor in tensors.items()}


def overall_checksum(per_tensor: Mapping[str, str]) -> str:
    """SGLang's per-rank digest: sha256 over name then checksum of every tensor, sorted by name."""
    digest = hashlib.sha256()
    for name in sorted(per_tensor):
        digest.update(name.encode())
        digest.update(per_tensor[name].encode())
    return digest.hexdigest()


def engine_checksum(per_rank: Iterable[str]) -> str:
    """SGLang's `per_engine_checksum`: sha256 over the per-rank digests in rank order."""
    digest = hashlib.sha256()
    for value in per_rank:
        digest.update(value.encode())
    return digest.hexdigest()
