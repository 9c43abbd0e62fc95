"""Sharded safetensors with an index, written as tensors arrive: at most one shard is held in memory.

Shards are named as transformers and SGLang expect (`model-00001-of-00003.safetensors`,
`model.safetensors.index.json` with `metadata.total_size` and `weight_map`); the count is known only at
the end, so each shard is written under a provisional name and renamed when the last one is done.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

INDEX_FILE = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 * 1024**3  # transformers' default max_shard_size


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class ShardWriter:
    """`add(name, tensor)` buffers a tensor (a contiguous copy: views of larger tensors do not keep them
    alive); a shard is written once the buffer would pass `shard_bytes`. `peak_bytes`: the most the buffer
    and the tensor being added held at once (what the streaming bound is tested on)."""

    def __init__(self, directory: Path, shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
        self.directory = directory
        self.shard_bytes = shard_bytes
        self.buffer: dict[str, torch.Tensor] = {}
        self.buffered = 0
        self.peak_bytes = 0
        self.largest_tensor = 0
        self.written: list[tuple[Path, list[str]]] = []
        self.total_size = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.buffer or any(name in names for _, names in self.written):
            raise ValueError(f"tensor {name!r} written twice")
        size = tensor_bytes(tensor)
        self.largest_tensor = max(self.largest_tensor, size)
        if self.buffer and self.buffered + size > self.shard_bytes:
            self._flush()
        self.buffer[name] = tensor.detach().to("cpu").contiguous().clone()
        self.buffered += size
        self.total_size += size
        self.peak_bytes = max(self.peak_bytes, self.buffered)

    def _flush(self) -> None:
        path = self.directory / f".shard-{len(self.written) + 1:05d}.safetensors"
        save_file(self.buffer, str(path), metadata={"format": "pt"})
        self.written.append((path, list(self.buffer)))
        self.buffer, self.buffered = {}, 0

    def close(self) -> dict[str, str]:
        """Write the last shard, give every shard its final name, write the index; {file: sha256}."""
        if self.buffer:
            self._flush()
        count = len(self.written)
        weight_map: dict[str, str] = {}
        checksums: dict[str, str] = {}
        for number, (path, names) in enumerate(self.written, start=1):
            final = self.directory / f"model-{number:05d}-of-{count:05d}.safetensors"
            path.rename(final)
            checksums[final.name] = sha256_file(final)
            weight_map.update(dict.fromkeys(names, final.name))
        index = {"metadata": {"total_size": self.total_size}, "weight_map": dict(sorted(weight_map.items()))}
        (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return checksums


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
