"""FP4 fake quantization inside DeepSeek-V4.1's forward: values rounded to FP4 and back, in place of the
real thing, where the served model computes on FP4 data.

SGLang 0.5.23 runs V4.1's indexer on FP4 queries and keys, and stores the compressed KV of its ratio-1 and
ratio-2 layers in FP4 (`sglang/kernels/ops/quantization/fp4_fake_quant.py`, applied after RoPE in
`srt/layers/attention/dsv4/dsv41_sparse.py: _rope_fq4`). A trainer whose forward skips the rounding scores
other positions and attends to other values than the engine that sampled. Two block formats, along the
last dimension:
- indexer queries and keys: 32 values share a power-of-two (UE8M0) scale, the smallest that maps the
  block's largest magnitude into E2M1's +-6 (as MXFP4 weights: `quant/mxfp4.py`);
- compressed KV: 16 values share an E4M3 scale, amax / 6 rounded to E4M3 (ties to even) and clamped to
  [2^-9, 448]; all-zero blocks stay zero.
Values round to the E2M1 grid, ties to even. The result has the input's dtype. Bitwise equal to SGLang's
functions in value (tests/quant/test_fp4_fake_sglang.py); the sign of a zero may differ, as between tools.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dsv4rl.quant.mxfp4 import AMAX_FLOOR, FP4_MAX, decode_e2m1, encode_e2m1
from dsv4rl.quant.scales import ceil_log2

INDEX_BLOCK = 32
KV_BLOCK = 16
E4M3_MAX = 448.0
E4M3_MIN_SCALE = 2.0**-9  # E4M3's smallest subnormal: the scale never reaches zero


def _blocks(x: Tensor, block: int) -> Tensor:
    if x.shape[-1] % block:
        raise ValueError(
            f"FP4 fake quantization needs the last dimension a multiple of {block}, got {tuple(x.shape)}"
        )
    return x.float().unflatten(-1, (-1, block))


def _round_e2m1(scaled: Tensor) -> Tensor:
    return decode_e2m1(encode_e2m1(scaled.clamp(-FP4_MAX, FP4_MAX)))


def fake_quant_index(x: Tensor, block: int = INDEX_BLOCK) -> Tensor:
    """x through FP4 with one power-of-two scale per `block` values of the last dimension, and back."""
    blocks = _blocks(x, block)
    # amax times the reciprocal of 6, the engine's arithmetic: the quotient differs from amax / 6 in the last
    # bit for a third of amax values (no scale was seen to differ, at 2^-126..2^126 boundaries or at random)
    # (not `scales.power_of_two_scale`: its finiteness check would synchronize a device on every forward)
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp(min=AMAX_FLOOR)
    scale = torch.exp2(ceil_log2(amax * (1.0 / FP4_MAX)).float())
    return (_round_e2m1(blocks / scale) * scale).flatten(-2).to(x.dtype)


def fake_quant_compressed_kv(x: Tensor) -> Tensor:
    """x through FP4 with one E4M3 scale per 16 values of the last dimension, and back."""
    blocks = _blocks(x, KV_BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    scale = (amax * (1.0 / FP4_MAX)).clamp(E4M3_MIN_SCALE, E4M3_MAX).to(torch.float8_e4m3fn).float()
    return (_round_e2m1(blocks / scale) * scale).flatten(-2).to(x.dtype)
