"""V4.1's FP4 fake quantization (quant/fp4_fake.py): the E2M1 grid with ties to even, the two scale
formats, zero blocks, the input's dtype, and a refused shape. SGLang's own functions are compared in
tests/quant/test_fp4_fake_sglang.py."""

from __future__ import annotations

import pytest
import torch

from dsv4rl.quant.fp4_fake import fake_quant_compressed_kv, fake_quant_index

# with the block's largest magnitude 6, the index scale is 1: each value lands on the grid as written
TIES = {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0, -5.0: -4.0, -1.75: -2.0}
NEAREST = {0.3: 0.5, 1.1: 1.0, 2.7: 3.0, 4.9: 4.0, 5.1: 6.0, -0.1: 0.0}


def block_of(values: dict[float, float], size: int) -> tuple[torch.Tensor, torch.Tensor]:
    given = [6.0, *values]
    want = [6.0, *values.values()]
    pad = size - len(given)
    return torch.tensor(given + [0.0] * pad), torch.tensor(want + [0.0] * pad)


@pytest.mark.parametrize("values", [TIES, NEAREST], ids=["ties_to_even", "nearest"])
def test_index_values_round_to_the_e2m1_grid(values):
    given, want = block_of(values, 32)
    assert torch.equal(fake_quant_index(given), want)


def test_the_index_scale_is_the_smallest_power_of_two_that_fits():
    # amax 12 -> scale 2 (12 / 2 = 6 fits); 13 -> scale 4: 13 / 4 = 3.25 rounds to 3, so 12 comes back
    assert fake_quant_index(torch.tensor([12.0] + [0.0] * 31))[0] == 12.0
    out = fake_quant_index(torch.tensor([13.0, 5.0] + [0.0] * 30))
    assert out[:2].tolist() == [12.0, 4.0]
    # each block of 32 has its own scale
    two = torch.cat([torch.full((32,), 0.1), torch.full((32,), 100.0)])
    assert fake_quant_index(two).tolist() == [0.09375] * 32 + [96.0] * 32  # scales 2^-5 and 2^5


def test_the_compressed_kv_scale_is_amax_over_6_rounded_to_e4m3():
    # amax 6.6 -> 1.1, which E4M3 holds as 1.125: 6.6 / 1.125 = 5.87 -> 6 -> 6.75; 16-value blocks
    block = torch.tensor([6.6, 1.0] + [0.0] * 14)
    assert fake_quant_compressed_kv(block)[:2].tolist() == [6.75, 1.125]
    # the same block through the index format: scale 2, 6.6 / 2 = 3.3 -> 3 -> 6.0
    assert fake_quant_index(torch.cat([block, torch.zeros(16)]))[0] == 6.0


def test_zero_blocks_stay_zero_and_the_dtype_is_kept():
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    for fake in (fake_quant_index, fake_quant_compressed_kv):
        out = fake(x)
        assert out.dtype == torch.bfloat16 and not out.any()


def test_values_already_in_fp4_come_back_unchanged():
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    x = (torch.cat([grid, -grid, grid, -grid]) * 0.25).repeat(3, 1)  # scale 1/4 in every block
    assert torch.equal(fake_quant_index(x), x)
    assert torch.equal(fake_quant_compressed_kv(x), x)


def test_a_last_dimension_off_the_block_is_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        fake_quant_index(torch.ones(2, 48))
    with pytest.raises(ValueError, match="multiple of 16"):
        fake_quant_compressed_kv(torch.ones(2, 24))
