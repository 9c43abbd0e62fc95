"""The number formats of a quantized weight, told apart by dtype: which quant modes quantize, and the
values a (weight, scale) pair stands for.

Which checkpoint tensor travels in which format is the model's knowledge (`dsv4rl.model.wire_format`);
this module knows only dtypes and scales, so a loader can dequantize whatever it reads.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dsv4rl.quant.fp8 import DEFAULT_BLOCK, E4M3, dequantize_fp8_blocks
from dsv4rl.quant.mxfp4 import dequantize_mxfp4


def dequantize(
    weight: Tensor,
    scale: Tensor | None,
    block: tuple[int, int] = DEFAULT_BLOCK,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """The values a (weight, scale) pair stands for, in `dtype`; a weight without scale is just cast.

    int8 weights are packed MXFP4 (1x32 scales), e4m3 weights FP8 blocks of `block`.
    """
    if scale is None:
        if weight.dtype in (E4M3, torch.int8):
            raise ValueError(f"a {weight.dtype} weight needs its scale to be dequantized")
        return weight if not weight.dtype.is_floating_point else weight.to(dtype)
    if weight.dtype == E4M3:
        return dequantize_fp8_blocks(weight, scale, block, dtype)
    if weight.dtype == torch.int8:
        return dequantize_mxfp4(weight, scale, dtype)
    raise ValueError(f"a {weight.dtype} weight has no scale to apply")
