"""DeepSeek-V4's RoPE: interleaved channel pairs (GPT-J style) on the trailing `rope_dim` channels.

Two frequency tables: "main" (sliding layers, plain RoPE) and "compress" (CSA/HCA layers and their
compressors, larger theta, optionally YaRN). The frequencies come from transformers' own rotary
module for the checkpoint's config, so YaRN and partial-rotary rules are the library's, not a copy.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding


class RotaryTables(torch.nn.Module):
    """One frequency table; `at(positions)` gives the half-width cos/sin rows, [S, rope_dim / 2]."""

    def __init__(self, inv_freq: Tensor, scaling: float) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.float().clone(), persistent=False)
        self.scaling = float(scaling)

    def at(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.to(positions.device)
        return (freqs.cos() * self.scaling).to(dtype), (freqs.sin() * self.scaling).to(dtype)


def rotary_tables(hf_config: DeepseekV4Config) -> dict[str, RotaryTables]:
    """{"main": ..., "compress": ...} for this config."""
    source = DeepseekV4RotaryEmbedding(hf_config, device=torch.device("cpu"))
    return {
        kind: RotaryTables(getattr(source, f"{kind}_inv_freq"), getattr(source, f"{kind}_attention_scaling"))
        for kind in ("main", "compress")
    }


def _rotate_pairs(x: Tensor) -> Tensor:
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def apply_interleaved_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, S, H, d]; cos/sin [S, r/2] -> x with its last r channels rotated (in float32)."""
    cos = cos.repeat_interleave(2, dim=-1).unsqueeze(-2)
    sin = sin.repeat_interleave(2, dim=-1).unsqueeze(-2)
    width = cos.shape[-1]
    nope, rope = x[..., :-width], x[..., -width:]
    rotated = (rope.float() * cos + _rotate_pairs(rope).float() * sin).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)
