"""Where the megatron backend's ranks read their weights from: only the tensors of their own shard.

A rank needs its pipeline stage's layers, its tensor-parallel slices and its experts. From a native
checkpoint (the release's names, FP8/MXFP4 with scales) `NativeCheckpointSource` reads exactly those
tensors from the safetensors files, one at a time, and dequantizes them; no rank ever materialises
the whole model. `StateDictSource` serves an in-memory transformers state dict (a transformers
directory, or tests).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from torch import Tensor

from dsv4rl.model.naming import hf_to_native, scale_name
from dsv4rl.model.native_checkpoint import block_size, checkpoint_files, read_config
from dsv4rl.quant.formats import dequantize


class TensorSource(Protocol):
    """Tensors under transformers names, in float32 (integer tables keep their dtype)."""

    def whole(self, hf_name: str) -> Tensor: ...

    def expert(self, hf_name: str, index: int) -> Tensor: ...


class StateDictSource:
    def __init__(self, state: Mapping[str, Tensor]) -> None:
        self.state = state

    def whole(self, hf_name: str) -> Tensor:
        return self.state[hf_name]

    def expert(self, hf_name: str, index: int) -> Tensor:
        return self.state[hf_name][index]


class NativeCheckpointSource:
    def __init__(self, directory: str | Path) -> None:
        self.block = block_size(read_config(directory))
        self.files: dict[str, Path] = {}
        for path in checkpoint_files(directory):
            with safe_open(str(path), framework="pt") as handle:
                self.files.update(dict.fromkeys(handle.keys(), path))  # noqa: SIM118

    def _read(self, name: str) -> Tensor | None:
        path = self.files.get(name)
        if path is None:
            return None
        with safe_open(str(path), framework="pt") as handle:
            return handle.get_tensor(name)

    def _native(self, name: str) -> Tensor:
        weight = self._read(name)
        if weight is None:
            raise KeyError(f"the checkpoint has no tensor {name!r}")
        scale = self._read(scale_name(name)) if name.endswith(".weight") else None
        return dequantize(weight, scale, self.block, torch.float32)

    def whole(self, hf_name: str) -> Tensor:
        ((native, _),) = hf_to_native(hf_name, torch.empty(0))
        return self._native(native)

    def expert(self, hf_name: str, index: int) -> Tensor:
        """One routed expert's slice of transformers' stacked tensor: cat[w1; w3] or w2."""
        layer = hf_name.removeprefix("model.layers.").split(".", 1)[0]
        prefix = f"layers.{layer}.ffn.experts.{index}."
        if hf_name.endswith("gate_up_proj"):
            return torch.cat([self._native(prefix + "w1.weight"), self._native(prefix + "w3.weight")])
        return self._native(prefix + "w2.weight")
