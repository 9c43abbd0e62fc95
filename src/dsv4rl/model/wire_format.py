"""The wire format of each quant mode: which native tensor travels in which dtype, with which scale.

`WireFormat.encode` turns one native (name, tensor) into what the engine is sent and holds: the tensor
itself, a cast, or a quantized weight followed by its `.scale`. Which tensors are quantized follows the
released checkpoint exactly (`dsv4rl.model.naming.checkpoint_kind`): norms, router, mHC, sinks,
embeddings and head are never quantized, and tid2eid stays an integer. `dsv4rl.quant.formats.dequantize`
inverts it from (weight, scale), dispatching on the weight's dtype as a loader must (the checkpoint, not
the model name, says whether experts are MXFP4 or FP8).

| mode | FP8-linears | routed experts | BF16-class | FP32-class | tid2eid |
|---|---|---|---|---|---|
| none | trainer dtype | trainer dtype | trainer dtype | trainer dtype | int64 |
| bf16 | bf16 | bf16 | bf16 | fp32 | int64 |
| fp8_rollout | e4m3 + 128x128 E8M0 | e4m3 + 128x128 scales | bf16 | fp32 | int64 |
| fp8_mxfp4 | e4m3 + 128x128 E8M0 | packed e2m1 + 1x32 scales | bf16 | fp32 | int64 |

Expert scales are E8M0 unless the engine holds them as float32 (`expert_scale_dtype`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from dsv4rl.config.choices import QuantMode
from dsv4rl.model.naming import CheckpointKind, checkpoint_kind, scale_name
from dsv4rl.quant.fp8 import DEFAULT_BLOCK, quantize_fp8_blocks
from dsv4rl.quant.mxfp4 import quantize_mxfp4
from dsv4rl.quant.scales import E8M0

NamedTensor = tuple[str, Tensor]


@dataclass(frozen=True)
class WireFormat:
    """How every native tensor travels in `mode`; scales of FP8 linears are always E8M0 (the checkpoint's)."""

    mode: QuantMode
    block: tuple[int, int] = DEFAULT_BLOCK
    expert_scale_dtype: torch.dtype = E8M0

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", QuantMode(self.mode))
        object.__setattr__(self, "block", tuple(int(b) for b in self.block))
        if self.expert_scale_dtype not in (E8M0, torch.float32):
            raise ValueError(f"expert scales are float8_e8m0fnu or float32, not {self.expert_scale_dtype}")

    @property
    def quantized(self) -> bool:
        return QuantMode(self.mode).quantized

    def encode(self, name: str, tensor: Tensor) -> list[NamedTensor]:
        """What the engine gets for native tensor `name`: [(name, tensor)] or [(name, q), (name.scale, s)]."""
        kind = checkpoint_kind(name)
        if self.mode == QuantMode.none or kind == CheckpointKind.integer:
            return [(name, tensor)]
        if kind == CheckpointKind.fp32:
            return [(name, tensor.to(torch.float32))]
        if kind == CheckpointKind.bf16 or self.mode == QuantMode.bf16:
            return [(name, tensor.to(torch.bfloat16))]
        if kind == CheckpointKind.fp8_linear:
            weight, scale = quantize_fp8_blocks(tensor, self.block, E8M0)
        elif self.mode == QuantMode.fp8_rollout:
            weight, scale = quantize_fp8_blocks(tensor, self.block, self.expert_scale_dtype)
        else:
            weight, scale = quantize_mxfp4(tensor, self.expert_scale_dtype)
        return [(name, weight), (scale_name(name), scale)]

    def encode_all(self, named: Iterable[NamedTensor]) -> dict[str, Tensor]:
        """{wire name: tensor} for a stream of native tensors (a checkpoint, or what an engine holds)."""
        out: dict[str, Tensor] = {}
        for name, tensor in named:
            out.update(self.encode(name, tensor.detach()))
        return out
