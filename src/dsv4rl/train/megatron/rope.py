"""DeepSeek-V4's RoPE: interleaved channel pairs (GPT-J style) on the trailing `rope_dim` channels.

Two frequency tables: "main" (sliding layers, plain RoPE) and "compress" (CSA/HCA layers and their
compressors, larger theta, optionally YaRN). The frequencies come from transformers' own rotary
module for the checkpoint's config, so YaRN and partial-rotary rules are the library's, not a copy.

The cos/sin tables stay float32 whatever the activations' dtype, and the rotation runs in float32
with one rounding of its result, as SGLang does: its tables are complex64 (`freqs_cis`,
sglang/srt/models/deepseek_v4.py:1199, built in float32 by
sglang/kernels/ops/attention/dsv4/rope.py:57-69) and its kernels read them as float32 and rotate
bf16 inputs in float32 registers (sglang/kernels/jit/csrc/deepseek_v4/main_norm_rope.cuh:74,175-197).
transformers casts the tables to the activations' dtype first
(transformers/models/deepseek_v4/modeling_deepseek_v4.py:153): in bf16 that rounds cos and sin to
8 significant bits, up to 2^-9 relative error on every rotated channel at every position.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding


class RotaryTables(torch.nn.Module):
    """One frequency table; `at(positions)` gives the half-width cos/sin rows, [S, rope_dim / 2], float32."""

    def __init__(self, inv_freq: Tensor, scaling: float) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.float().clone(), persistent=False)
        self.scaling = float(scaling)

    def at(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """float32 cos/sin at `positions` (a float32 buffer even if the module was cast)."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.to(positions.device, torch.float32)
        return freqs.cos() * self.scaling, freqs.sin() * self.scaling


def rotary_tables(hf_config: DeepseekV4Config) -> dict[str, RotaryTables]:
    """{"main": ..., "compress": ...} for this config."""
    source = DeepseekV4RotaryEmbedding(hf_config, device=torch.device("cpu"))
    return {
        kind: RotaryTables(getattr(source, f"{kind}_inv_freq"), getattr(source, f"{kind}_attention_scaling"))
        for kind in ("main", "compress")
    }


def _rotate_pairs(x: Tensor) -> Tensor:
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, S, H, d]; cos/sin [S, r/2] float32 -> x with its last r channels rotated, in float32
    (the caller rounds once, where its module hands the result on)."""
    cos = cos.float().repeat_interleave(2, dim=-1).unsqueeze(-2)
    sin = sin.float().repeat_interleave(2, dim=-1).unsqueeze(-2)
    width = cos.shape[-1]
    x = x.float()
    nope, rope = x[..., :-width], x[..., -width:]
    return torch.cat([nope, rope * cos + _rotate_pairs(rope) * sin], dim=-1)


def apply_interleaved_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """`rotate`, rounded once to x's dtype."""
    return rotate(x, cos, sin).to(x.dtype)
