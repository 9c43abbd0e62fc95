"""MXFP4 weights: e2m1 values packed two per byte with one power-of-two scale per 1x32 block.

DeepSeek-V4's released checkpoint stores each routed expert's w1/w2/w3 [out, in] this way (and SGLang's
MXFP4 MoE holds the same bytes):
- `weight`: int8 [out, in/2]; byte k of a row holds element 2k in its low nibble and 2k+1 in its high one;
- a nibble is sign (bit 3) | magnitude index (bits 0-2) into [0, 0.5, 1, 1.5, 2, 3, 4, 6];
- `scale`: [out, in/32] powers of two (E8M0 in the checkpoint; SGLang holds them as E8M0 with aiter on
  ROCm and as float32 elsewhere);
- W[i, j] = value(nibble(i, j)) * S[i, j // 32].
Quantising a block: s = 2^ceil(log2(max(amax, 6 * 2^-126) / 6)), then each W / s is rounded to the nearest
grid value, ties to the even code (round-to-nearest-even, like a hardware cast). Tools differ on ties and
on the sign of zero, so compare dequantised values, not bytes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dsv4rl.quant.scales import E8M0, power_of_two_scale, to_scale_dtype

BLOCK = 32
FP4_MAX = 6.0
AMAX_FLOOR = 6.0 * 2.0**-126
VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _check(weight: Tensor) -> None:
    if weight.dim() != 2:
        raise ValueError(f"MXFP4 quantisation takes 2-D weights, got shape {tuple(weight.shape)}")
    if weight.shape[1] % BLOCK:
        raise ValueError(
            f"MXFP4 needs the input dimension to be a multiple of {BLOCK}, got shape {tuple(weight.shape)}"
        )


def _nearest_even_code(value: float) -> int:
    """The e2m1 magnitude code nearest to `value`; between two, the even one (round half to even)."""
    distances = [abs(value - grid) for grid in VALUES]
    best = min(distances)
    nearest = [code for code, distance in enumerate(distances) if distance == best]
    return nearest[0] if len(nearest) == 1 else next(code for code in nearest if code % 2 == 0)


# In quarters, every rounding boundary (0.25, 0.75, ..., 5) is an integer: the code of |x| only depends
# on floor(4|x|) and on whether 4|x| is exactly that integer. Entry 2k: |x| = k/4; entry 2k+1: the open
# interval (k/4, (k+1)/4).
_CODE_BY_QUARTER = torch.tensor([_nearest_even_code(j / 8) for j in range(49)], dtype=torch.uint8)


def encode_e2m1(values: Tensor) -> Tensor:
    """Nibble codes (uint8, 0..15) of values already on the e2m1 scale (|x| <= 6), nearest, ties to even."""
    quarters = values.float().abs().mul_(4.0)
    whole = quarters.floor()
    index = whole.mul(2.0).add_((quarters > whole).to(whole.dtype)).clamp_(max=48).to(torch.int64)
    code = _CODE_BY_QUARTER[index]
    return code | (((values < 0) & (code > 0)).to(torch.uint8) << 3)  # no negative zero


def decode_e2m1(codes: Tensor) -> Tensor:
    """float32 values of nibble codes."""
    lut = torch.tensor(VALUES)
    magnitude = lut[(codes & 7).long()]
    return torch.where((codes & 8) > 0, -magnitude, magnitude)


def pack_nibbles(codes: Tensor) -> Tensor:
    """[out, in] codes -> int8 [out, in/2], element 2k in the low nibble of byte k."""
    pairs = codes.to(torch.uint8).view(codes.shape[0], -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).view(torch.int8)


def unpack_nibbles(packed: Tensor) -> Tensor:
    """int8 [out, in/2] -> uint8 codes [out, in]."""
    if packed.dtype not in (torch.int8, torch.uint8):
        raise ValueError(f"packed MXFP4 weights are int8, got {packed.dtype}")
    data = packed.view(torch.uint8)
    return torch.stack((data & 0xF, data >> 4), dim=-1).view(packed.shape[0], -1)


def quantize_mxfp4(weight: Tensor, scale_dtype: torch.dtype = E8M0) -> tuple[Tensor, Tensor]:
    """(packed int8 [out, in/2], scale [out, in/32] in `scale_dtype`)."""
    _check(weight)
    rows, cols = weight.shape
    blocks = weight.float().reshape(rows, cols // BLOCK, BLOCK)
    scale = power_of_two_scale(blocks.abs().amax(dim=-1), FP4_MAX, AMAX_FLOOR)
    codes = encode_e2m1((blocks * (1.0 / scale).unsqueeze(-1)).view(rows, cols))  # 1/2^k is exact
    return pack_nibbles(codes), to_scale_dtype(scale, scale_dtype)


def dequantize_mxfp4(packed: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """W [out, in] in `dtype` from packed nibbles and their 1x32 scales."""
    codes = unpack_nibbles(packed)
    rows, cols = codes.shape
    if tuple(scale.shape) != (rows, cols // BLOCK):
        raise ValueError(
            f"scale shape {tuple(scale.shape)} does not fit packed weight {tuple(packed.shape)} "
            f"(expected {(rows, cols // BLOCK)}: one scale per {BLOCK} elements)"
        )
    values = decode_e2m1(codes).view(rows, cols // BLOCK, BLOCK) * scale.float().unsqueeze(-1)
    return values.view(rows, cols).to(dtype)
