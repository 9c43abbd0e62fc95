"""FP8 e4m3 128x128 block quantisation against hand-computed bytes, its error bound and edge cases."""

import pytest
import torch

from dsv4rl.quant.fp8 import (
    E4M3,
    block_amax,
    dequantize_fp8_blocks,
    quantize_fp8_blocks,
    scale_shape,
)
from dsv4rl.quant.scales import E8M0, ceil_log2, power_of_two_scale


def test_hand_computed_bytes():
    # amax 3 -> s = 2^ceil(log2(3/448)) = 2^-7; W/s = 128, -256, 64, 384
    weight = torch.tensor([[1.0, -2.0], [0.5, 3.0]])
    q, s = quantize_fp8_blocks(weight)
    assert q.dtype == E4M3 and s.dtype == E8M0 and s.shape == (1, 1)
    assert s.view(torch.uint8).item() == 127 - 7
    # e4m3: sign | 4-bit exponent (bias 7) | 3-bit mantissa
    # 128 = 2^7 -> 0 1110 000; -256 = -2^8 -> 1 1111 000; 64 -> 0 1101 000; 384 = 1.5 * 2^8 -> 0 1111 100
    assert q.view(torch.uint8).tolist() == [[0x70, 0xF8], [0x68, 0x7C]]
    assert torch.equal(dequantize_fp8_blocks(q, s), weight)


def test_round_to_nearest_even_and_no_saturation():
    # amax 448 -> s = 1; 1.0625 lies halfway between 1.0 (mantissa 000) and 1.125 (001): even is 1.0;
    # 1.1875 halfway between 1.125 (001) and 1.25 (010): even is 1.25
    weight = torch.tensor([[448.0, 1.0625, 1.1875, -448.0]])
    q, s = quantize_fp8_blocks(weight)
    assert s.float().item() == 1.0
    assert q.float().tolist() == [[448.0, 1.0, 1.25, -448.0]]


@pytest.mark.parametrize("shape", [(64, 32), (128, 128), (200, 300), (1, 129), (257, 3)])
def test_error_bound_and_idempotence(shape):
    generator = torch.Generator().manual_seed(sum(shape))
    weight = torch.randn(shape, generator=generator) * torch.logspace(-3, 1, shape[1])  # mixed magnitudes
    q, s = quantize_fp8_blocks(weight)
    assert tuple(s.shape) == scale_shape(shape) == (-(-shape[0] // 128), -(-shape[1] // 128))
    deq = dequantize_fp8_blocks(q, s)
    # 3 mantissa bits: half a step is 2^-4 of the value; below 2^-6 (subnormals) a step is 2^-9 of the scale
    per_element = torch.zeros(shape)
    per_element[:, :] = s.float().repeat_interleave(128, 0).repeat_interleave(128, 1)[: shape[0], : shape[1]]
    assert bool(((deq - weight).abs() <= weight.abs() * 2**-4 + per_element * 2**-10).all())
    # every tile's largest magnitude maps into (224, 448]: the scale is the smallest that fits
    scaled_amax = block_amax(weight) / s.float()
    assert bool((scaled_amax <= 448).all()) and bool((scaled_amax > 224).all())
    q2, s2 = quantize_fp8_blocks(deq)
    assert torch.equal(dequantize_fp8_blocks(q2, s2), deq)


def test_partial_edge_tiles_get_their_own_scale():
    weight = torch.full((130, 129), 0.01)
    weight[128:, 128:] = 100.0  # the 2x1 corner tile alone
    q, s = quantize_fp8_blocks(weight)
    assert s.shape == (2, 2)
    assert s.float().tolist() == [[2.0**-15, 2.0**-15], [2.0**-15, 2.0**-2]]
    torch.testing.assert_close(dequantize_fp8_blocks(q, s), weight, rtol=2**-4, atol=0)


def test_zero_and_tiny_blocks_stay_finite():
    weight = torch.zeros(128, 256)
    weight[:, 128:] = 1e-30
    q, s = quantize_fp8_blocks(weight)
    # both tiles hit the amax floor 1e-4: s = 2^ceil(log2(1e-4 / 448)) = 2^-22
    assert s.float().tolist() == [[2.0**-22, 2.0**-22]]
    deq = dequantize_fp8_blocks(q, s)
    assert bool(torch.isfinite(deq).all()) and bool((deq == 0).all())


def test_float32_scales_and_checks():
    q, s = quantize_fp8_blocks(torch.ones(4, 4), scale_dtype=torch.float32)
    assert s.dtype == torch.float32 and s.item() == 2.0**-8
    with pytest.raises(ValueError, match="NaN or infinite"):
        quantize_fp8_blocks(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="2-D"):
        quantize_fp8_blocks(torch.ones(4))
    with pytest.raises(ValueError, match="does not fit"):
        dequantize_fp8_blocks(q, torch.ones(2, 1))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        dequantize_fp8_blocks(torch.ones(4, 4), s)


def test_power_of_two_scales_are_exact():
    # the fp32 -> e8m0 cast rounds to nearest (3.0 -> 4.0, but 1.4 -> 1.0): scales never go through it
    assert ceil_log2(torch.tensor([1.0, 2.0, 3.0, 0.75, 2.0**-126])).tolist() == [0, 1, 2, 0, -126]
    assert power_of_two_scale(torch.tensor([448.0 * 1.4]), 448.0, 1e-4).item() == 2.0
    assert power_of_two_scale(torch.tensor([448.0 * 2]), 448.0, 1e-4).item() == 2.0
