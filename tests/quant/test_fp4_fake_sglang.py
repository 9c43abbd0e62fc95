"""dsv4rl's FP4 fake quantization for DeepSeek-V4.1 (quant/fp4_fake.py) against SGLang 0.5.23's own
functions, in SGLang's interpreter: equal values on random activations at many magnitudes, in float32 and
bfloat16, on exact ties, zero and tiny blocks, and blocks past E4M3's largest scale. Negative control: the
ties rounded half away from zero differ from what SGLang returns."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv4rl.quant.fp4_fake import fake_quant_compressed_kv, fake_quant_index
from sglang_runner import needs_sglang

pytestmark = [*needs_sglang, pytest.mark.slow]

TIES = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -1.75, -2.5, -5.0]


def inputs() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    out = {}
    for magnitude in (1e-30, 1e-6, 1e-2, 1.0, 37.0, 1e4):
        x = torch.randn(4, 3, 128, generator=generator) * magnitude
        out[f"randn_{magnitude:g}"] = x
        out[f"randn_{magnitude:g}_bf16"] = x.to(torch.bfloat16)
    ties = torch.tensor(TIES + [0.0] * (32 - len(TIES)))
    out["ties"] = ties.repeat(2, 1)
    out["ties_scaled"] = (ties * 2.0**-7).repeat(2, 1)
    out["zeros"] = torch.zeros(2, 64)
    out["tiny"] = torch.full((2, 64), 2.0**-130)
    out["past_e4m3"] = torch.randn(2, 64, generator=generator) * 1e4 + 3e3  # amax / 6 > 448: the scale clamps
    out["one_outlier"] = torch.cat([torch.full((1, 31), 0.01), torch.full((1, 1), 50.0)], dim=1).repeat(3, 1)
    return out


def half_away_from_zero(x: torch.Tensor) -> torch.Tensor:
    """E2M1 with ties away from zero, on values whose scale is 1 (the `ties` rows)."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    magnitude = x.abs().unsqueeze(-1)
    distance = (magnitude - grid).abs()
    best = distance.min(dim=-1, keepdim=True).values
    return torch.where(distance == best, grid, -1.0).amax(dim=-1) * x.sign()


def test_sglang_fake_quantizes_as_dsv4rl_does(tmp_path: Path, sglang_sides) -> None:
    given = inputs()
    save_file(given, str(tmp_path / "inputs.safetensors"))
    sglang_sides.get().call(
        "fp4_fake_quant:apply",
        inputs=str(tmp_path / "inputs.safetensors"),
        out=str(tmp_path / "out.safetensors"),
    )
    theirs = load_file(str(tmp_path / "out.safetensors"))
    assert len(theirs) == 2 * len(given)
    for name, x in given.items():
        for kind, ours in (("index", fake_quant_index(x)), ("kv", fake_quant_compressed_kv(x))):
            expected = theirs[f"{name}.{kind}"]
            assert ours.dtype == expected.dtype == x.dtype, (name, kind)
            # values compared (== treats -0.0 and 0.0 alike: tools differ on a zero's sign)
            assert torch.equal(ours, expected), (name, kind, (ours != expected).sum().item())
    # the comparison sees a rounding rule: ties away from zero is not what SGLang does
    away = half_away_from_zero(given["ties"][0])
    assert not torch.equal(away, theirs["ties.index"][0]), away
    assert torch.equal(away.abs() >= theirs["ties.index"][0].abs(), torch.ones(32, dtype=torch.bool))
