"""The rounding rules of SGLang 0.5.23's DeepSeek-V4 kernels, as pure tensor functions.

Each function returns the values the released kernel produces (in float32), so an fp32 model can compute
with SGLang's numbers (`dsv4rl.model.sglang_numerics` installs them on the transformers model). Citations
are to the SGLang 0.5.23 wheel; `docs/numerics.md` lists them all. `straight_through` turns any of them
into a fake quantization for training (forward: the rounded value; backward: identity).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value (math::FP8_E4M3_MAX in SGLang's kernels)
KV_SCALE_FLOOR = 1e-4  # main_norm_rope.cuh:432: fmaxf(1e-4f, abs_max)
ACT_SCALE_EPS = 1e-10  # fp8_kernel.py:492 (sglang_per_token_group_quant_fp8's eps)
KV_BLOCK = 64  # one UE8M0 scale per 64 nope dims (one warp of main_norm_rope.cuh)
ACT_GROUP = 128  # per-(token, 128-channel) activation groups of the W8A8 block GEMMs


def round_bf16(x: Tensor) -> Tensor:
    """Round to bfloat16 (nearest even) and back: a bf16 tensor at a module boundary."""
    return x.to(torch.bfloat16).to(x.dtype)


def round_tf32(x: Tensor) -> Tensor:
    """float32 -> TF32 (10 explicit mantissa bits) by dropping the low 13 bits, as the tensor cores read
    raw fp32 operands; SGLang's own split of the mHC weight uses the same mask (`mhc.py:2571-2574`,
    `weight.view(torch.int32) & -8192`)."""
    bits = x.to(torch.float32).contiguous().view(torch.int32)
    return (bits & -8192).view(torch.float32).to(x.dtype)


def ue8m0_scale(amax: Tensor) -> Tensor:
    """The KV cache's per-64-dim scale: the power of two at or above max(1e-4, amax) / 448.

    `main_norm_rope.cuh:431-434` computes `fmaxf(1e-4f, abs_max) / FP8_E4M3_MAX` and `cast_to_ue8m0`
    (`fp8_utils.cuh:31-36`) rounds it up to a power of two (exponent + 1 when any mantissa bit is set)."""
    raw = torch.clamp(amax.to(torch.float32), min=KV_SCALE_FLOOR) / E4M3_MAX
    bits = raw.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    exponent = exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent << 23).view(torch.float32)


def _blocks(x: Tensor, width: int) -> tuple[Tensor, int]:
    """`x` [..., D] as [..., ceil(D / width), width], zero-padded; and the padding."""
    pad = (-x.shape[-1]) % width
    padded = torch.nn.functional.pad(x, (0, pad)) if pad else x
    return padded.reshape(*x.shape[:-1], padded.shape[-1] // width, width), pad


def _unblock(x: Tensor, pad: int) -> Tensor:
    flat = x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])
    return flat[..., : flat.shape[-1] - pad] if pad else flat


def fp8_kv_nope(x: Tensor, block: int = KV_BLOCK) -> Tensor:
    """The nope dims of a KV cache entry as SGLang stores and reads them: e4m3 with one UE8M0 scale per
    `block` dims (`main_norm_rope.cuh:427-437`: `x * inv_scale` packed to e4m3, read back times the scale;
    the division by a power of two is exact)."""
    blocks, pad = _blocks(x.to(torch.float32), block)
    scale = ue8m0_scale(blocks.abs().amax(dim=-1, keepdim=True))
    quantized = (blocks / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    return _unblock(quantized * scale, pad).to(x.dtype)


def fp8_kv_entry(x: Tensor, rope_dim: int, block: int = KV_BLOCK) -> Tensor:
    """A whole KV cache entry [..., head_dim]: the leading nope dims in FP8 (`fp8_kv_nope`), the trailing
    `rope_dim` dims in bf16 (`main_norm_rope.cuh:424-425`, the rope warp's bf16 store)."""
    nope, rope = x[..., : x.shape[-1] - rope_dim], x[..., x.shape[-1] - rope_dim :]
    return torch.cat([fp8_kv_nope(nope, block), round_bf16(rope)], dim=-1)


def fp8_activation(x: Tensor, group: int = ACT_GROUP, ue8m0: bool = False) -> Tensor:
    """Dynamic per-(token, `group`-channel) e4m3 quantization of a W8A8 GEMM input, read back.

    The scale is max(amax, 1e-10) / 448 in fp32 and the values are multiplied by its reciprocal on
    Hopper (`kernels/ops/quantization/fp8_kernel.py:166-169`); `ue8m0=True` rounds the scale up to a
    power of two and divides, as the UE8M0 variant does on Blackwell (`fp8_kernel.py:216-220`)."""
    blocks, pad = _blocks(x.to(torch.float32), group)
    scale = blocks.abs().amax(dim=-1, keepdim=True).clamp(min=ACT_SCALE_EPS) / E4M3_MAX
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
        scaled = blocks / scale
    else:
        scaled = blocks * (1.0 / scale)
    quantized = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    return _unblock(quantized * scale, pad).to(x.dtype)


class _StraightThrough(torch.autograd.Function):
    """Forward: `fn(x)`; backward: the gradient passes unchanged (a fake quantization)."""

    @staticmethod
    def forward(ctx, x: Tensor, fn: Callable[[Tensor], Tensor]) -> Tensor:  # type: ignore[override]
        return fn(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad, None


def straight_through(fn: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """`fn` as a straight-through estimator: exact forward values, identity gradient."""

    def apply(x: Tensor) -> Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            return _StraightThrough.apply(x, fn)
        return fn(x)

    return apply
