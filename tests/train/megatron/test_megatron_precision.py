"""Where the Megatron port rounds in bf16: at the points where SGLang computes in float32 (the mHC
expand, the attention core with its sinks, the compressors' gated pooling, RoPE and the q norm) the port
computes in float32 and rounds once where the module hands its result on.

Each test feeds bf16 inputs (float32 parameters where the model keeps them float32) and checks that the
output is the exact result, computed in float64 from the same inputs, rounded once to bf16. A float32
computation rounded once lands on that value except where the exact result lies within float32 error of
a bf16 rounding midpoint (about 1e-4 of the elements here), so at least 99% must be equal. Then it
checks that doing the same step in bf16 (as transformers does, or as the port did) fails the same
check: one intermediate bf16 rounding moves 14-72% of the outputs here off that value (RoPE's 14%: only
half the channels rotate), so the thresholds (99% and 95%) tell the two apart with margin.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

from dsv4rl.train.megatron.attention import attend
from dsv4rl.train.megatron.compressor import Compressor
from dsv4rl.train.megatron.hyper_connection import expand, unweighted_rms_norm
from dsv4rl.train.megatron.rope import RotaryTables, apply_interleaved_rope, rotate

BF16 = torch.bfloat16
ROUNDED_ONCE = 0.99  # the port: fraction of outputs equal to the exact result rounded once
ROUNDED_TWICE = 0.95  # a bf16 intermediate: that fraction stays below this


def rounded_once(actual: torch.Tensor, exact: torch.Tensor) -> float:
    """The fraction of `actual` (bf16) equal to the float64 `exact` rounded once to bf16."""
    assert actual.dtype == BF16
    return float((actual == exact.to(BF16)).float().mean())


def generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def tables(rope_dim: int = 16, theta: float = 10000.0) -> RotaryTables:
    return RotaryTables(1.0 / (theta ** (torch.arange(0, rope_dim, 2).float() / rope_dim)), 1.0)


def exact_rotate(
    x: torch.Tensor, rope: RotaryTables, positions: torch.Tensor, sign: float = 1.0
) -> torch.Tensor:
    """float64 RoPE of x [B, S, H, d] on its trailing channels, at the port's float32 angles."""
    angles = (positions.float().unsqueeze(-1) * rope.inv_freq).double()
    cos = (angles.cos() * rope.scaling).repeat_interleave(2, -1).unsqueeze(-2)
    sin = (sign * angles.sin() * rope.scaling).repeat_interleave(2, -1).unsqueeze(-2)
    x = x.double()
    width = cos.shape[-1]
    nope, tail = x[..., :-width], x[..., -width:]
    pairs = torch.stack((-tail[..., 1::2], tail[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([nope, tail * cos + pairs * sin], dim=-1)


# -- mHC expand ------------------------------------------------------------------------------------


def test_mhc_expand_mixes_in_float32():
    """X' = post (x) y + comb^T X from float32 post/comb and bf16 y, X: one rounding (SGLang's
    deepseek_v4_mhc.py:602-606); transformers rounds post and comb and mixes in bf16."""
    g = generator()
    post = 2 * torch.rand(2, 48, 4, generator=g)
    comb = torch.softmax(torch.randn(2, 48, 4, 4, generator=g), dim=-1)
    output = torch.randn(2, 48, 96, generator=g).to(BF16)
    streams = torch.randn(2, 48, 4, 96, generator=g).to(BF16)
    exact = post.double().unsqueeze(-1) * output.double().unsqueeze(-2) + torch.matmul(
        comb.double().transpose(-1, -2), streams.double()
    )
    mixed = expand(post, comb, output, streams)
    assert mixed.dtype == BF16
    assert rounded_once(mixed, exact) >= ROUNDED_ONCE

    in_bf16 = post.to(BF16).unsqueeze(-1) * output.unsqueeze(-2) + torch.matmul(
        comb.to(BF16).transpose(-1, -2), streams
    )
    assert rounded_once(in_bf16, exact) < ROUNDED_TWICE


# -- attention core --------------------------------------------------------------------------------


def _attention_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Logits of a few units and sinks in [4, 8) off the bf16 grid (spacing 1/32 there), so the sink
    holds a large share of the softmax and rounding it to bf16 shows."""
    g = generator()
    seq, heads, dim, window = 48, 4, 32, 8
    q = (2 * torch.randn(1, seq, heads, dim, generator=g)).to(BF16)
    keys = (2 * torch.randn(1, seq, dim, generator=g)).to(BF16)
    distance = torch.arange(seq).view(-1, 1) - torch.arange(seq).view(1, -1)
    visible = (distance >= 0) & (distance < window)
    bias = torch.zeros(1, seq, seq).masked_fill(~visible, float("-inf"))
    sinks = 4 + 4 * torch.rand(heads, generator=g) + 1 / 97
    return q, keys, bias, sinks, dim**-0.5


def _exact_attend(q: Tensor, keys: Tensor, bias: Tensor, sinks: Tensor, scale: float) -> Tensor:
    q, keys = q.double(), keys.double()
    logits = torch.matmul(q.transpose(1, 2), keys.transpose(-1, -2).unsqueeze(1)) * scale
    logits = logits + bias.unsqueeze(1).double()
    sink = sinks.double().view(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
    probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, keys.unsqueeze(1)).transpose(1, 2)


def _attend_variant(
    q: Tensor,
    keys: Tensor,
    bias: Tensor,
    sinks: Tensor,
    scale: float,
    *,
    logits_bf16: bool,
    sink_bf16: bool,
    softmax_bf16: bool,
) -> Tensor:
    """The attention core with chosen steps in bf16: transformers' (bf16 logits, float32 softmax
    with the float32 sink), the port's former all-bf16 core, or only the sink rounded."""
    dtype = BF16 if logits_bf16 else torch.float32
    logits = torch.matmul(q.to(dtype).transpose(1, 2), keys.to(dtype).transpose(-1, -2).unsqueeze(1)) * scale
    logits = logits + bias.unsqueeze(1).to(dtype)
    sink = sinks.to(BF16) if sink_bf16 else sinks
    sink = sink.to(BF16 if softmax_bf16 else torch.float32).view(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
    combined = torch.cat([logits.to(sink.dtype), sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1].to(BF16)
    return torch.matmul(probs, keys.unsqueeze(1)).transpose(1, 2)


def test_attention_core_runs_in_float32():
    """Logits, bias, float32 sinks, softmax and the sum over values in float32, one rounding on the
    output (SGLang's flash_mla_sm120_triton.py:99-204, 303-322; the sink float32 at
    sglang/srt/models/deepseek_v4.py:1092)."""
    q, keys, bias, sinks, scale = _attention_inputs()
    exact = _exact_attend(q, keys, bias, sinks, scale)
    out = attend(q, keys, bias, sinks, scale)
    assert out.dtype == BF16
    assert rounded_once(out, exact) >= ROUNDED_ONCE


@pytest.mark.parametrize(
    "variant",
    [
        {"logits_bf16": True, "sink_bf16": False, "softmax_bf16": False},  # transformers
        {"logits_bf16": False, "sink_bf16": True, "softmax_bf16": False},  # the sink rounded
        {"logits_bf16": True, "sink_bf16": True, "softmax_bf16": True},  # everything in bf16
    ],
    ids=["bf16_logits", "bf16_sink", "all_bf16"],
)
def test_attention_core_in_bf16_is_told_apart(variant):
    q, keys, bias, sinks, scale = _attention_inputs()
    exact = _exact_attend(q, keys, bias, sinks, scale)
    assert rounded_once(_attend_variant(q, keys, bias, sinks, scale, **variant), exact) < ROUNDED_TWICE


# -- compressor gated pooling ----------------------------------------------------------------------


def _compressor(ratio: int, overlap: bool) -> Compressor:
    config = TransformerConfig(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        params_dtype=BF16,
        bf16=True,
        layernorm_epsilon=1e-6,
    )
    compressor = Compressor(config, ratio, head_dim=32, rope_dim=16, overlap=overlap)
    g = generator()
    with torch.no_grad():
        for parameter in (compressor.linear_wkv.weight, compressor.linear_wgate.weight, compressor.ape):
            parameter.copy_(torch.randn(parameter.shape, generator=g) * 0.5)
        compressor.norm.weight.copy_(1 + 0.1 * torch.randn(compressor.norm.weight.shape, generator=g))
    return compressor


def _windows(
    kv: Tensor, gate: Tensor, ape: Tensor, ratio: int, head_dim: int, overlap: bool
) -> tuple[Tensor, Tensor]:
    """[B, S, C] -> the [B, W, slots, head_dim] kv and gate (+ position bias) slots (CSA: previous
    window's first half, this window's second half; the first window's previous half empty)."""
    batch, windows = kv.shape[0], kv.shape[1] // ratio
    kv = kv[:, : windows * ratio].view(batch, windows, ratio, -1)
    gate = gate[:, : windows * ratio].view(batch, windows, ratio, -1) + ape
    if not overlap:
        return kv, gate
    previous_kv = torch.cat([torch.zeros_like(kv[:, :1, :, :head_dim]), kv[:, :-1, :, :head_dim]], dim=1)
    empty = torch.full_like(gate[:, :1, :, :head_dim], float("-inf"))
    previous_gate = torch.cat([empty, gate[:, :-1, :, :head_dim]], dim=1)
    return (
        torch.cat([previous_kv, kv[..., head_dim:]], dim=2),
        torch.cat([previous_gate, gate[..., head_dim:]], dim=2),
    )


def _compress(
    compressor: Compressor,
    hidden: torch.Tensor,
    rope: RotaryTables,
    *,
    exact: bool = False,
    projections_bf16: bool = False,
    pooling_bf16: bool = False,
) -> torch.Tensor:
    """The compressor's path written out: float64 throughout (`exact`), or the port's float32 with the
    projections or the pooling rounded to bf16 as transformers does (modeling_deepseek_v4.py:428, 685)."""
    wide = torch.float64 if exact else torch.float32
    x = hidden.to(wide)
    kv = F.linear(x, compressor.linear_wkv.weight.to(wide))
    gate = F.linear(x, compressor.linear_wgate.weight.to(wide))
    if projections_bf16:
        kv, gate = kv.to(BF16).to(wide), gate.to(BF16).to(wide)
    ratio, head_dim = compressor.ratio, compressor.head_dim
    kv, gate = _windows(kv, gate, compressor.ape.to(wide), ratio, head_dim, compressor.overlap)
    weights = gate.softmax(dim=2)
    if pooling_bf16:
        pooled = (kv.to(BF16) * weights.to(BF16)).sum(dim=2).to(wide)
    else:
        pooled = (kv * weights).sum(dim=2)
    normed = pooled * torch.rsqrt(pooled.square().mean(-1, keepdim=True) + compressor.norm.eps)
    normed = normed * compressor.norm.weight.to(wide)
    positions = torch.arange(normed.shape[1]) * ratio
    if exact:
        return exact_rotate(normed.unsqueeze(2), rope, positions).squeeze(2)
    cos, sin = rope.at(positions)
    return rotate(normed.unsqueeze(2), cos, sin).squeeze(2).to(BF16)


@pytest.mark.parametrize(("ratio", "overlap"), [(4, True), (16, False)], ids=["csa", "hca"])
def test_compressor_pools_in_float32(ratio, overlap):
    """Projections out in float32, the softmax-gated sum, norm and RoPE in float32, one rounding on the
    entries (SGLang: compressor.py:160-166, compressor_v2.py:112-131, c4_v2.cuh:182-214)."""
    compressor = _compressor(ratio, overlap)
    rope = tables(theta=160000.0)
    hidden = torch.randn(2, 8 * ratio, 64, generator=generator()).to(BF16)
    with torch.no_grad():
        entries = compressor(hidden, rope)
        exact = _compress(compressor, hidden, rope, exact=True)
        assert entries.dtype == BF16 and entries.shape == exact.shape
        assert torch.equal(entries, _compress(compressor, hidden, rope))  # the written-out path is the port's
        assert rounded_once(entries, exact) >= ROUNDED_ONCE
        assert rounded_once(_compress(compressor, hidden, rope, pooling_bf16=True), exact) < ROUNDED_TWICE
        assert rounded_once(_compress(compressor, hidden, rope, projections_bf16=True), exact) < ROUNDED_TWICE


# -- RoPE tables and the q norm --------------------------------------------------------------------


def test_rope_tables_stay_float32():
    """cos/sin float32 whatever the activations' dtype, the rotation in float32, one rounding
    (SGLang's complex64 freqs_cis, sglang/srt/models/deepseek_v4.py:1199; transformers casts the tables
    to the activations' dtype, modeling_deepseek_v4.py:153)."""
    rope = tables()
    positions = torch.arange(0, 8192, 7)
    cos, sin = rope.at(positions)
    assert cos.dtype == sin.dtype == torch.float32
    x = torch.randn(1, positions.numel(), 4, 32, generator=generator()).to(BF16)
    exact = exact_rotate(x, rope, positions)
    rotated = apply_interleaved_rope(x, cos, sin)
    assert rotated.dtype == BF16
    assert rounded_once(rotated, exact) >= ROUNDED_ONCE
    assert rounded_once(apply_interleaved_rope(x, cos.to(BF16), sin.to(BF16)), exact) < ROUNDED_TWICE
    # the inverse rotation on the attention output, the same way
    back = apply_interleaved_rope(x, cos, -sin)
    assert rounded_once(back, exact_rotate(x, rope, positions, sign=-1.0)) >= ROUNDED_ONCE


def test_unweighted_rms_norm_multiplies_in_float32():
    """x / rms(x) with the float32 factor, one rounding (SGLang's main_norm_rope.cuh:133-151);
    transformers rounds the factor to bf16 first (modeling_deepseek_v4.py:72)."""
    x = (3 * torch.randn(64, 4, 128, generator=generator())).to(BF16)
    wide = x.double()
    exact = wide * torch.rsqrt(wide.square().mean(-1, keepdim=True) + 1e-6)
    normed = unweighted_rms_norm(x, 1e-6)
    assert normed.dtype == BF16
    assert rounded_once(normed, exact) >= ROUNDED_ONCE
    factor_bf16 = x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + 1e-6).to(BF16)
    assert rounded_once(factor_bf16, exact) < ROUNDED_TWICE
