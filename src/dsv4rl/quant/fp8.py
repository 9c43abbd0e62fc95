"""FP8 e4m3 weights with 128x128 power-of-two block scales: DeepSeek-V4's format for its linear layers.

The released checkpoint (and SGLang's `Fp8LinearMethod`, block [128, 128]) stores a weight W [out, in] as
- `weight`: `float8_e4m3fn` Q [out, in] (max 448, 3 mantissa bits);
- `scale`: one power of two per 128x128 tile, shape [ceil(out/128), ceil(in/128)] (edge tiles partial),
  in the checkpoint as E8M0;
- W[i, j] = Q[i, j] * S[i // 128, j // 128].
Quantising a tile: s = 2^ceil(log2(max(amax, 1e-4) / 448)) (the `ue8m0` rule of DeepSeek's kernels), then
Q = round-to-nearest-even(W / s); |W / s| <= 448, so nothing saturates. The rule is idempotent on its own
output: requantising a dequantised tensor gives the same dequantised values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dsv4rl.quant.scales import E8M0, power_of_two_scale, to_scale_dtype

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4  # DeepSeek's ue8m0 kernels floor the block amax here
DEFAULT_BLOCK = (128, 128)


def scale_shape(shape: tuple[int, int], block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[int, int]:
    """[ceil(out / block_out), ceil(in / block_in)]."""
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def _check_2d(weight: Tensor, block: tuple[int, int]) -> None:
    if weight.dim() != 2:
        raise ValueError(f"FP8 block quantisation takes 2-D weights, got shape {tuple(weight.shape)}")
    if len(block) != 2 or min(block) < 1:
        raise ValueError(f"block must be two positive sizes, got {block}")


def _tiles(weight: Tensor, block: tuple[int, int]) -> Tensor:
    """float32 [rows/b0, b0, cols/b1, b1] view of `weight`, zero-padded to whole tiles."""
    rows, cols = scale_shape(tuple(weight.shape), block)
    data = weight.float()
    pad_rows, pad_cols = rows * block[0] - weight.shape[0], cols * block[1] - weight.shape[1]
    if pad_rows or pad_cols:
        data = F.pad(data, (0, pad_cols, 0, pad_rows))
    return data.reshape(rows, block[0], cols, block[1])


def block_amax(weight: Tensor, block: tuple[int, int] = DEFAULT_BLOCK) -> Tensor:
    """max |W| over each tile, [ceil(out/b0), ceil(in/b1)] float32 (partial edge tiles padded with 0)."""
    _check_2d(weight, block)
    return _tiles(weight, block).abs().amax(dim=(1, 3))


def quantize_fp8_blocks(
    weight: Tensor, block: tuple[int, int] = DEFAULT_BLOCK, scale_dtype: torch.dtype = E8M0
) -> tuple[Tensor, Tensor]:
    """(Q `float8_e4m3fn` [out, in], scale [ceil(out/b0), ceil(in/b1)] in `scale_dtype`)."""
    _check_2d(weight, block)
    tiles = _tiles(weight, block)
    scale = power_of_two_scale(tiles.abs().amax(dim=(1, 3)), E4M3_MAX, AMAX_FLOOR)
    quantized = (tiles * (1.0 / scale)[:, None, :, None]).to(E4M3)  # 1/2^k is exact
    quantized = quantized.reshape(tiles.shape[0] * block[0], -1)[: weight.shape[0], : weight.shape[1]]
    return quantized.contiguous(), to_scale_dtype(scale, scale_dtype)


def dequantize_fp8_blocks(
    quantized: Tensor,
    scale: Tensor,
    block: tuple[int, int] = DEFAULT_BLOCK,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """W = Q * S per tile, in `dtype`; checks the scale grid fits the weight and the block size."""
    _check_2d(quantized, block)
    if quantized.dtype != E4M3:
        raise ValueError(f"FP8 weights are float8_e4m3fn, got {quantized.dtype}")
    expected = scale_shape(tuple(quantized.shape), block)
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"scale shape {tuple(scale.shape)} does not fit weight {tuple(quantized.shape)} with "
            f"{block[0]}x{block[1]} blocks (expected {expected})"
        )
    tiles = _tiles(quantized, block) * scale.float()[:, None, :, None]
    return tiles.reshape(expected[0] * block[0], -1)[: quantized.shape[0], : quantized.shape[1]].to(dtype)
