"""Names of DeepSeek-V4 tensors: transformers (HF 5.23) <-> native checkpoint names.

The trainer holds an HF model; the wire carries native checkpoint names (what SGLang loads, and
what the released safetensors use), with routed experts split per expert into w1/w2/w3.
The mapping is transformers 5.23's DeepSeek-V4 conversion table (`conversion_mapping.py`) against the
released checkpoint's names (deepseek-ai/DeepSeek-V4-Flash, `inference/model.py`), checked both ways on
the tiny model (tests/model/test_naming.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum

import torch

# Suffixes under `model.layers.N.` (HF) and `layers.N.` (native); experts are handled apart.
_LAYER_SUFFIXES: dict[str, str] = {
    "self_attn.sinks": "attn.attn_sink",
    "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.kv_norm.weight": "attn.kv_norm.weight",
    "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "self_attn.compressor.kv_proj.weight": "attn.compressor.wkv.weight",
    "self_attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
    "self_attn.compressor.kv_norm.weight": "attn.compressor.norm.weight",
    "self_attn.compressor.position_bias": "attn.compressor.ape",
    "self_attn.compressor.indexer.kv_proj.weight": "attn.indexer.compressor.wkv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
    "self_attn.compressor.indexer.kv_norm.weight": "attn.indexer.compressor.norm.weight",
    "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "attn_hc.fn": "hc_attn_fn",
    "attn_hc.base": "hc_attn_base",
    "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn",
    "ffn_hc.base": "hc_ffn_base",
    "ffn_hc.scale": "hc_ffn_scale",
}
_GLOBALS: dict[str, str] = {
    "model.embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}
_NATIVE_LAYER_SUFFIXES = {native: hf for hf, native in _LAYER_SUFFIXES.items()}
_NATIVE_GLOBALS = {native: hf for hf, native in _GLOBALS.items()}

_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_NATIVE_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_NATIVE_EXPERT = re.compile(r"^ffn\.experts\.(\d+)\.(w1|w2|w3)\.weight$")


class CheckpointKind(StrEnum):
    """How the released DeepSeek-V4 checkpoint stores a tensor, which decides how each quant mode sends it."""

    fp8_linear = "fp8_linear"  # FP8 e4m3 + 128x128 E8M0 `.scale`: attention and shared-expert linears
    routed_expert = "routed_expert"  # MXFP4 (int8-packed e2m1) + 1x32 E8M0 `.scale`
    bf16 = "bf16"  # embed, head, norms, router weight, compressor and indexer projections
    fp32 = "fp32"  # mHC mixing, attention sinks, compressor position biases, router selection bias
    integer = "integer"  # the hash-routing table tid2eid (int64), never through a float cast


_FP8_LINEAR = re.compile(
    r"^layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|ffn\.shared_experts\.w[123])\.weight$"
)
_ROUTED_EXPERT = re.compile(r"^layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")
_FP32 = re.compile(
    r"^(hc_head_(fn|base|scale)|layers\.\d+\.(hc_(attn|ffn)_(fn|base|scale)|attn\.attn_sink"
    r"|attn\.(indexer\.)?compressor\.ape|ffn\.gate\.bias))$"
)
SCALE_SUFFIX = ".scale"


def checkpoint_kind(native_name: str) -> CheckpointKind:
    """The release's storage class of a native tensor name (its `.scale` companions excluded)."""
    if _FP8_LINEAR.match(native_name):
        return CheckpointKind.fp8_linear
    if _ROUTED_EXPERT.match(native_name):
        return CheckpointKind.routed_expert
    if _FP32.match(native_name):
        return CheckpointKind.fp32
    if native_name.endswith(".ffn.gate.tid2eid"):
        return CheckpointKind.integer
    return CheckpointKind.bf16


def scale_name(weight_name: str) -> str:
    """`layers.0.attn.wq_a.weight` -> `layers.0.attn.wq_a.scale` (the release names scales per module)."""
    if not weight_name.endswith(".weight"):
        raise UnknownTensorName(f"only `.weight` tensors have a `.scale`: {weight_name!r}")
    return weight_name.removesuffix(".weight") + SCALE_SUFFIX


def weight_name_of(scale: str) -> str:
    """The weight a `.scale` tensor belongs to."""
    if not scale.endswith(SCALE_SUFFIX):
        raise UnknownTensorName(f"not a `.scale` tensor name: {scale!r}")
    return scale.removesuffix(SCALE_SUFFIX) + ".weight"


class UnknownTensorName(KeyError):
    """A name with no counterpart in the other naming scheme."""


@dataclass(frozen=True)
class HFSlot:
    """Where one native tensor lives in the HF state dict: a whole tensor or one expert's rows."""

    hf_name: str
    expert: int | None = None
    # For routed experts: "gate" (w1, first half of gate_up_proj), "up" (w3, second half), "down" (w2).
    part: str | None = None


def native_slot(native_name: str) -> HFSlot:
    """The HF tensor (and expert slice) a native checkpoint name writes to."""
    if native_name in _NATIVE_GLOBALS:
        return HFSlot(_NATIVE_GLOBALS[native_name])
    match = _NATIVE_LAYER.match(native_name)
    if match is None:
        raise UnknownTensorName(f"not a DeepSeek-V4 native tensor name: {native_name!r}")
    layer, suffix = match.groups()
    prefix = f"model.layers.{layer}."
    if suffix in _NATIVE_LAYER_SUFFIXES:
        return HFSlot(prefix + _NATIVE_LAYER_SUFFIXES[suffix])
    expert = _NATIVE_EXPERT.match(suffix)
    if expert is None:
        raise UnknownTensorName(f"not a DeepSeek-V4 native tensor name: {native_name!r}")
    index, which = int(expert.group(1)), expert.group(2)
    if which == "w2":
        return HFSlot(prefix + "mlp.experts.down_proj", index, "down")
    return HFSlot(prefix + "mlp.experts.gate_up_proj", index, "gate" if which == "w1" else "up")


def hf_to_native(hf_name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Native (name, tensor) pairs for one HF tensor; routed experts split per expert, no copies."""
    if hf_name in _GLOBALS:
        yield _GLOBALS[hf_name], tensor
        return
    match = _HF_LAYER.match(hf_name)
    if match is None:
        raise UnknownTensorName(f"not a DeepSeek-V4 transformers tensor name: {hf_name!r}")
    layer, suffix = match.groups()
    prefix = f"layers.{layer}."
    if suffix in _LAYER_SUFFIXES:
        yield prefix + _LAYER_SUFFIXES[suffix], tensor
    elif suffix == "mlp.experts.gate_up_proj":
        half = tensor.shape[1] // 2  # [E, 2I, H]: w1 rows then w3 rows, no transpose
        for expert in range(tensor.shape[0]):
            yield f"{prefix}ffn.experts.{expert}.w1.weight", tensor[expert, :half]
            yield f"{prefix}ffn.experts.{expert}.w3.weight", tensor[expert, half:]
    elif suffix == "mlp.experts.down_proj":
        for expert in range(tensor.shape[0]):
            yield f"{prefix}ffn.experts.{expert}.w2.weight", tensor[expert]
    else:
        raise UnknownTensorName(f"not a DeepSeek-V4 transformers tensor name: {hf_name!r}")


def state_dict_to_native(state: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    for hf_name, tensor in state.items():
        yield from hf_to_native(hf_name, tensor)


def slot_view(state: Mapping[str, torch.Tensor], slot: HFSlot) -> torch.Tensor:
    """The part of the HF state tensor that `slot` names (a view, so copying into it writes through)."""
    if slot.hf_name not in state:
        raise UnknownTensorName(f"the model has no tensor {slot.hf_name!r}")
    tensor = state[slot.hf_name]
    if slot.expert is None:
        return tensor
    if slot.part == "down":
        return tensor[slot.expert]
    half = tensor.shape[1] // 2
    return tensor[slot.expert, :half] if slot.part == "gate" else tensor[slot.expert, half:]


@torch.no_grad()
def copy_native_into(state: Mapping[str, torch.Tensor], native_name: str, tensor: torch.Tensor) -> None:
    """Write one native tensor into an HF state dict (parameters and buffers), checking its shape."""
    target = slot_view(state, native_slot(native_name))
    if tuple(target.shape) != tuple(tensor.shape):
        raise ValueError(
            f"{native_name}: shape {tuple(tensor.shape)} does not match the model's {tuple(target.shape)}"
        )
    if target.dtype.is_floating_point != tensor.dtype.is_floating_point:
        raise ValueError(f"{native_name}: dtype {tensor.dtype} cannot be loaded into {target.dtype}")
    target.copy_(tensor)
