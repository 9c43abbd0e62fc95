"""Power-of-two (UE8M0) scales shared by the FP8 and MXFP4 formats.

A UE8M0 scale is 2^k stored as the biased exponent byte k + 127 (`torch.float8_e8m0fnu`: no sign, no
mantissa; byte 255 is NaN, so k spans -127..127). Both DeepSeek-V4 formats pick, per block, the smallest
power of two that maps the block's largest magnitude into the element format's range:
s = 2^ceil(log2(amax / max_value)). Computed with `frexp`, not `log2`, so powers of two are exact, and
never through an fp32 -> e8m0 cast, which rounds to nearest (3.0 -> 4.0 but 1.4 -> 1.0).
"""

from __future__ import annotations

import torch
from torch import Tensor

E8M0 = torch.float8_e8m0fnu
MIN_EXPONENT = -127
MAX_EXPONENT = 127


def ceil_log2(x: Tensor) -> Tensor:
    """ceil(log2(x)) for positive finite float32 x, exactly (x = m * 2^e with m in [0.5, 1))."""
    mantissa, exponent = torch.frexp(x.float())
    return exponent - (mantissa == 0.5).to(exponent.dtype)


def power_of_two_scale(amax: Tensor, max_value: float, floor: float) -> Tensor:
    """Per-block scale 2^ceil(log2(max(amax, floor) / max_value)) as float32.

    `floor` keeps all-zero and tiny blocks finite and bounds the exponent from below. Raises on a
    non-finite amax: a NaN or inf weight would otherwise saturate silently in the FP8 cast.
    """
    if not bool(torch.isfinite(amax).all()):
        raise ValueError("cannot quantize a tensor with NaN or infinite values")
    exponent = ceil_log2(amax.float().clamp(min=floor) / max_value)
    if bool((exponent > MAX_EXPONENT).any()):
        raise ValueError(f"a block's magnitude needs a scale above 2^{MAX_EXPONENT}: not representable")
    return torch.exp2(exponent.clamp(min=MIN_EXPONENT).float())


def to_scale_dtype(scale: Tensor, dtype: torch.dtype) -> Tensor:
    """Store power-of-two scales as E8M0 (exact) or float32."""
    if dtype not in (E8M0, torch.float32):
        raise ValueError(f"scales are stored as float8_e8m0fnu or float32, not {dtype}")
    return scale.to(dtype)
