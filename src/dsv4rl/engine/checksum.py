"""sha256 checksums of a model's tensors in native DeepSeek names, for /weights_checker.

A trainer can compute the same numbers on its side (`checksums(state_dict)`) to verify a weight sync
bit for bit: per tensor over the raw bytes, and one combined digest over the sorted (name, digest) list.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch

from dsv4rl.model.naming import state_dict_to_native


def tensor_sha256(tensor: torch.Tensor) -> str:
    """Digest of the raw bytes of `tensor` (contiguous, CPU), so any dtype including fp8 works."""
    data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


def checksums(state: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """{native name: sha256} for an HF-named state dict (parameters and buffers)."""
    return {name: tensor_sha256(tensor) for name, tensor in state_dict_to_native(state)}


def combined_checksum(per_tensor: Mapping[str, str]) -> str:
    """One digest for the whole model: sha256 over the sorted "name:digest" lines."""
    lines = "\n".join(f"{name}:{digest}" for name, digest in sorted(per_tensor.items()))
    return hashlib.sha256(lines.encode()).hexdigest()
