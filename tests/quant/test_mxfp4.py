"""MXFP4 (e2m1, two per byte, 1x32 E8M0 scales) against hand-computed bytes, its error bound and edges."""

import pytest
import torch

from dsv4rl.quant.mxfp4 import (
    VALUES,
    decode_e2m1,
    dequantize_mxfp4,
    encode_e2m1,
    pack_nibbles,
    quantize_mxfp4,
    unpack_nibbles,
)
from dsv4rl.quant.scales import E8M0


def test_hand_computed_bytes():
    row = [0.5, -6.0, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0] + [0.0] * 24  # amax 6 -> scale 1
    packed, scale = quantize_mxfp4(torch.tensor([row]))
    assert packed.dtype == torch.int8 and packed.shape == (1, 16) and scale.shape == (1, 1)
    assert scale.dtype == E8M0 and scale.view(torch.uint8).item() == 127
    # element 2k in the low nibble: (0.5 -> 1, -6 -> 8|7=15) -> 0xF1; (1 -> 2, 1.5 -> 3) -> 0x32; ...
    assert packed.view(torch.uint8)[0, :4].tolist() == [0xF1, 0x32, 0x54, 0x76]
    assert packed.view(torch.uint8)[0, 4:].tolist() == [0] * 12


def test_ties_round_to_the_even_code():
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert decode_e2m1(encode_e2m1(midpoints)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert decode_e2m1(encode_e2m1(-midpoints)).tolist() == [0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0]
    assert encode_e2m1(torch.tensor([-0.1])).item() == 0  # no negative zero
    codes = torch.arange(16, dtype=torch.uint8).view(1, 16)
    assert torch.equal(unpack_nibbles(pack_nibbles(codes)), codes)
    assert decode_e2m1(torch.arange(8, dtype=torch.uint8)).tolist() == list(VALUES)


def test_block_scales():
    weight = torch.zeros(1, 96)
    weight[0, 0] = 12.0  # block 0: 12/6 = 2 -> 2^1
    weight[0, 32] = 6.1  # block 1: 6.1/6 -> 2^1 (never saturate)
    weight[0, 64] = 0.75  # block 2: 0.75/6 = 0.125 -> 2^-3
    _, scale = quantize_mxfp4(weight, scale_dtype=torch.float32)
    assert scale.tolist() == [[2.0, 2.0, 0.125]]


@pytest.mark.parametrize("shape", [(32, 64), (64, 32), (3, 96)])
def test_error_bound_and_idempotence(shape):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(shape[0]))
    packed, scale = quantize_mxfp4(weight)
    deq = dequantize_mxfp4(packed, scale)
    s = scale.float().repeat_interleave(32, dim=1)
    x = (weight / s).abs()
    # half the grid step: 0.25 below 2, 0.5 up to 4, 1 up to 6 (in units of the block's scale)
    half_step = torch.where(x <= 2, 0.25, torch.where(x <= 4, 0.5, 1.0))
    assert bool(((deq - weight).abs() <= half_step * s + 1e-12).all())
    packed2, scale2 = quantize_mxfp4(deq)
    assert torch.equal(dequantize_mxfp4(packed2, scale2), deq)


def test_zero_and_tiny_blocks():
    weight = torch.zeros(2, 32)
    weight[1] = 1e-40  # a float32 subnormal
    packed, scale = quantize_mxfp4(weight)
    assert scale.view(torch.uint8).tolist() == [[1], [1]]  # the floor 6 * 2^-126 -> scale 2^-126
    assert bool((dequantize_mxfp4(packed, scale) == 0).all())


def test_checks():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.ones(2, 48))
    with pytest.raises(ValueError, match="NaN or infinite"):
        quantize_mxfp4(torch.full((1, 32), float("inf")))
    packed, scale = quantize_mxfp4(torch.ones(2, 64))
    with pytest.raises(ValueError, match="one scale per 32"):
        dequantize_mxfp4(packed, torch.ones(2, 1))
    with pytest.raises(ValueError, match="int8"):
        dequantize_mxfp4(torch.ones(2, 32), scale)
