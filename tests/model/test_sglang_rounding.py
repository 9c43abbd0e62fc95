"""SGLang 0.5.23's rounding rules against values worked out by hand."""

from __future__ import annotations

import torch

from dsv4rl.model.sglang_rounding import (
    fp8_activation,
    fp8_kv_entry,
    fp8_kv_nope,
    round_bf16,
    round_tf32,
    straight_through,
    ue8m0_scale,
)


def test_bf16_rounds_to_nearest_even() -> None:
    # bf16 keeps 8 significant bits: between 1 and 2 the step is 2^-7
    x = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-9, 256.0 + 1.0])
    assert round_bf16(x).tolist() == [1.0, 1 + 2**-6, 1.0, 256.0]
    assert round_bf16(x).dtype == torch.float32


def test_tf32_drops_the_low_13_mantissa_bits() -> None:
    # TF32 keeps 10 explicit mantissa bits: 1 + 2^-10 survives, 1 + 2^-11 is dropped, and truncation (not
    # rounding) takes 1 + 2^-10 + 2^-11 + 2^-12 to 1 + 2^-10
    x = torch.tensor([1 + 2**-10, 1 + 2**-11, 1 + 2**-10 + 2**-11 + 2**-12, -(1 + 2**-11)])
    assert round_tf32(x).tolist() == [1 + 2**-10, 1.0, 1 + 2**-10, -1.0]


def test_ue8m0_scale_is_the_power_of_two_at_or_above_amax_over_448() -> None:
    # 448 / 448 = 1 exactly -> 1; 449 / 448 just above 1 -> 2; 0 is floored at 1e-4 -> 2^-22 (1e-4/448 =
    # 2.23e-7, in (2^-23, 2^-22]); 224 / 448 = 0.5 exactly -> 0.5
    amax = torch.tensor([448.0, 449.0, 0.0, 224.0, 3.0])
    assert ue8m0_scale(amax).tolist() == [1.0, 2.0, 2.0**-22, 0.5, 2.0**-7]


def test_fp8_kv_nope_uses_one_scale_per_64_dims() -> None:
    # block 0: amax 3 -> scale 2^-7 (3/448 = 0.0067 in (2^-8, 2^-7]); 1.1 / 2^-7 = 140.8, and e4m3 steps by
    # 16 in [128, 256): 144 -> 144 * 2^-7 = 1.125. Block 1: amax 0.5 -> scale 2^-9; 0.3 / 2^-9 = 153.6 -> 160
    # -> 0.3125. Each block's scale comes from its own maximum.
    x = torch.zeros(128)
    x[0], x[1] = 3.0, 1.1
    x[64], x[65] = 0.5, 0.3
    out = fp8_kv_nope(x)
    assert out[[0, 1, 64, 65]].tolist() == [3.0, 1.125, 0.5, 0.3125]
    assert out[2:64].abs().max() == 0


def test_fp8_kv_entry_keeps_the_rope_dims_in_bf16() -> None:
    x = torch.full((2, 80), 1.1)  # 64 nope dims + 16 rope dims
    out = fp8_kv_entry(x, rope_dim=16)
    assert out[:, :64].unique().tolist() == [1.125]  # e4m3: amax 1.1 -> scale 2^-8, 281.6 -> 288 -> 1.125
    assert out[:, 64:].unique().tolist() == [round_bf16(torch.tensor(1.1)).item()]  # 1.1015625


def test_fp8_kv_entry_of_no_entries_is_empty() -> None:
    assert fp8_kv_entry(torch.zeros(3, 1, 0, 32), rope_dim=16).shape == (3, 1, 0, 32)


def test_fp8_activation_scale_is_amax_over_448_per_128_channels() -> None:
    # amax 448 -> scale 1 exactly: 100.0 stays on the e4m3 grid (step 8 in [64, 128) -> 96 or 104: 100 is a
    # tie, to even -> 96); channels 128.. form their own group with amax 0.001
    x = torch.zeros(1, 256)
    x[0, 0], x[0, 1] = 448.0, 100.0
    x[0, 128] = 0.001
    out = fp8_activation(x)
    assert out[0, :2].tolist() == [448.0, 96.0]
    assert torch.isclose(out[0, 128], torch.tensor(0.001), rtol=1e-6)  # the group's max maps to 448 exactly


def test_fp8_activation_scale_is_per_token() -> None:
    x = torch.tensor([[448.0, 100.0], [4480.0, 1000.0]])  # the second row is the first x 10
    out = fp8_activation(x)
    assert out[0].tolist() == [448.0, 96.0]
    assert torch.allclose(out[1], out[0] * 10)


def test_fp8_activation_ue8m0_rounds_the_scale_up_to_a_power_of_two() -> None:
    x = torch.tensor([[300.0, 100.0]])  # 300/448 -> scale 1: 300 -> 288 (step 32 in [256, 448]), 100 -> 96
    assert fp8_activation(x, ue8m0=True).tolist() == [[288.0, 96.0]]


def test_straight_through_rounds_forward_and_passes_the_gradient() -> None:
    x = torch.tensor([1.1, -2.3], requires_grad=True)
    y = straight_through(round_bf16)(x)
    assert y.tolist() == round_bf16(x.detach()).tolist()
    (y * torch.tensor([3.0, 5.0])).sum().backward()
    assert x.grad.tolist() == [3.0, 5.0]
