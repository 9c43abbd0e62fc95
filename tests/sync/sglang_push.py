"""The trainer's half of `test_sglang_load_weights`: a push written as the requests and payload bytes the
weight sync sends, and what each SGLang 0.5.23 parameter must hold once SGLang has loaded it.

`push_buckets` runs dsv4rl's own pipeline (`wire_buckets`: native names -> the wire format -> buckets, each
sorted for flattening as `WeightSync` sends it); `write_requests` writes every request's body
(`bucket_metadata` plus `load_format`) and the bytes its broadcast carries (`flatten_bucket`).

`expected_sglang_params` is the other side of the contract, written from reading SGLang's
`DeepseekV4ForCausalLM.load_weights` (`sglang/srt/models/deepseek_v4.py:5251-5644`) and its layers: which
parameter each native tensor lands in, after SGLang's renames (`remap_weight_name_to_dpsk_hf_format`,
:5113), fusions (wq_a + wkv -> wqkv_a, compressor wkv + wgate -> wkv_gate, w1 + w3 -> gate_up /
w13 per expert) and transforms (the compressor's APE re-layout at ratio 4, `compressor.py:118-138`; wo_a
de-quantized to BF16 when SGLang keeps it unquantized, `deepseek_v4.py:5671-5743`). Every value is the
sent tensor cast to the parameter's dtype, which is what SGLang's loaders' `copy_` does, so the test
compares bit for bit.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch import Tensor

from dsv4rl.model.wire_format import WireFormat
from dsv4rl.sync.pipeline import wire_buckets
from dsv4rl.wire.layout import (
    FLATTENED_BUCKET,
    NamedTensor,
    bucket_metadata,
    flatten_bucket,
    sort_for_flattening,
)

_GLOBALS = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head_fn",
    "hc_head_base": "model.hc_head_base",
    "hc_head_scale": "model.hc_head_scale",
}
# native suffix under layers.N. -> SGLang suffix under model.layers.N. (one tensor, one parameter)
_DIRECT = {
    "attn.attn_sink": "self_attn.attn_sink",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.wq_b.weight": "self_attn.wq_b.weight",
    "attn.wq_b.scale": "self_attn.wq_b.weight_scale_inv",
    "attn.wo_b.weight": "self_attn.wo_b.weight",
    "attn.wo_b.scale": "self_attn.wo_b.weight_scale_inv",
    "attn.compressor.norm.weight": "self_attn.compressor.norm.weight",
    "attn.indexer.wq_b.weight": "self_attn.indexer.wq_b.weight",
    "attn.indexer.wq_b.scale": "self_attn.indexer.wq_b.weight_scale_inv",
    "attn.indexer.weights_proj.weight": "self_attn.indexer.weights_proj.weight",
    "attn.indexer.compressor.norm.weight": "self_attn.indexer.compressor.norm.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.topk.tid2eid",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "ffn.shared_experts.w2.scale": "mlp.shared_experts.down_proj.weight_scale_inv",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **{
        f"hc_{part}_{kind}": f"hc_{part}_{kind}"
        for part in ("attn", "ffn")
        for kind in ("fn", "base", "scale")
    },
}
# SGLang parameter suffix -> the native suffixes concatenated along dim 0, in order
_FUSED = {
    "self_attn.wqkv_a.weight": ("attn.wq_a.weight", "attn.wkv.weight"),
    "self_attn.wqkv_a.weight_scale_inv": ("attn.wq_a.scale", "attn.wkv.scale"),
    "self_attn.compressor.wkv_gate.weight": ("attn.compressor.wkv.weight", "attn.compressor.wgate.weight"),
    "self_attn.indexer.compressor.wkv_gate.weight": (
        "attn.indexer.compressor.wkv.weight",
        "attn.indexer.compressor.wgate.weight",
    ),
    "mlp.shared_experts.gate_up_proj.weight": (
        "ffn.shared_experts.w1.weight",
        "ffn.shared_experts.w3.weight",
    ),
    "mlp.shared_experts.gate_up_proj.weight_scale_inv": (
        "ffn.shared_experts.w1.scale",
        "ffn.shared_experts.w3.scale",
    ),
}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])\.(weight|scale)$")


def push_buckets(
    named_weights: Iterable[NamedTensor],
    wire_format: WireFormat | None,
    bucket_bytes: int,
    load_format: str | None,
) -> list[list[NamedTensor]]:
    """The requests of one push, each in the order `WeightSync` sends its tensors."""
    buckets = wire_buckets(named_weights, wire_format, bucket_bytes)
    return [sort_for_flattening(b) if load_format == FLATTENED_BUCKET else list(b) for b in buckets]


def write_requests(
    buckets: list[list[NamedTensor]], load_format: str | None, directory: Path
) -> dict[str, Tensor]:
    """Write each request's body (`requests.json`) and broadcast bytes (`<i>.bin`); return what was sent."""
    directory.mkdir(parents=True, exist_ok=True)
    requests, sent = [], {}
    for index, bucket in enumerate(buckets):
        requests.append({**bucket_metadata(bucket), "load_format": load_format})
        (directory / f"{index}.bin").write_bytes(flatten_bucket(bucket, "cpu").numpy().tobytes())
        for name, tensor in bucket:
            assert name not in sent, f"{name} sent twice"
            sent[name] = tensor
    (directory / "requests.json").write_text(json.dumps(requests))
    return sent


def _ape_as_loaded(ape: Tensor, ratio: int) -> Tensor:
    """`Compressor._apply_ape_hotfix`: at ratio 4 (overlapping windows) the two halves of the last dim
    are stacked along the rows, then viewed back to [ratio, 2 * head_dim]."""
    if ratio != 4:
        return ape
    first, second = torch.chunk(ape, 2, dim=-1)
    return torch.cat([first, second], dim=0).reshape(ratio, -1)


def _dequant_to_bf16(weight: Tensor, scale: Tensor) -> Tensor:
    bn, bk = weight.shape[0] // scale.shape[0], weight.shape[1] // scale.shape[1]
    full = scale.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)
    return (weight.float() * full).to(torch.bfloat16)


def expected_sglang_params(
    sent: Mapping[str, Tensor], config: Mapping, held: Mapping[str, tuple[str, list[int]]]
) -> tuple[dict[str, Tensor], dict[str, str]]:
    """{SGLang parameter: the value it must hold} for a complete push `sent` (native names), and
    {SGLang parameter: why its comparison is partial}. `held` is SGLang's {parameter: (dtype, shape)}."""
    ratios = config["compress_ratios"]
    sources: dict[str, Tensor] = {}
    notes: dict[str, str] = {}
    experts: dict[tuple[int, str], dict[int, Tensor]] = {}
    for name, tensor in sent.items():
        if name in _GLOBALS:
            sources[_GLOBALS[name]] = tensor
            continue
        match = _LAYER.match(name)
        assert match, f"no SGLang parameter is expected for {name}"
        layer, suffix = int(match.group(1)), match.group(2)
        prefix = f"model.layers.{layer}."
        expert = _EXPERT.match(suffix)
        if expert:
            e, w, kind = int(expert.group(1)), expert.group(2), expert.group(3)
            experts.setdefault((layer, f"{w}.{kind}"), {})[e] = tensor
        elif suffix in ("attn.compressor.ape", "attn.indexer.compressor.ape"):
            ratio = 4 if "indexer" in suffix else ratios[layer]
            sources[prefix + "self_attn." + suffix.removeprefix("attn.")] = _ape_as_loaded(tensor, ratio)
        elif suffix in _DIRECT:
            sources[prefix + _DIRECT[suffix]] = tensor
        elif suffix in ("attn.wo_a.weight", "attn.wo_a.scale"):
            continue  # below, as a pair
        else:
            assert any(suffix in parts for parts in _FUSED.values()), f"no SGLang parameter for {name}"
    for layer in range(config["num_hidden_layers"]):
        prefix, native = f"model.layers.{layer}.", f"layers.{layer}."
        for param, parts in _FUSED.items():
            present = [native + p in sent for p in parts]
            if any(present):
                assert all(present), f"{prefix}{param}: only some of {parts} were sent"
                sources[prefix + param] = torch.cat([sent[native + p] for p in parts], dim=0)
        wo_a, wo_a_scale = sent[native + "attn.wo_a.weight"], sent.get(native + "attn.wo_a.scale")
        if wo_a_scale is not None and held[prefix + "self_attn.wo_a.weight"][0] == "bfloat16":
            sources[prefix + "self_attn.wo_a.weight"] = _dequant_to_bf16(wo_a, wo_a_scale)
        else:
            sources[prefix + "self_attn.wo_a.weight"] = wo_a
            if wo_a_scale is not None:
                sources[prefix + "self_attn.wo_a.weight_scale_inv"] = wo_a_scale

    def stacked(layer: int, part: str) -> Tensor:  # [experts, ...] in expert order
        by_expert = experts[(layer, part)]
        return torch.stack([by_expert[e] for e in sorted(by_expert)])

    for layer, part in list(experts):
        prefix = f"model.layers.{layer}.mlp.experts."
        kind = part.split(".")[1]
        suffix = "weight" if kind == "weight" else "weight_scale_inv"
        if part.startswith("w2"):
            sources[f"{prefix}w2_{suffix}"] = stacked(layer, part)
        elif part.startswith("w1"):  # gate then up, per expert: FusedMoE's w13 shards
            sources[f"{prefix}w13_{suffix}"] = torch.cat(
                [stacked(layer, part), stacked(layer, f"w3.{kind}")], 1
            )
    expected = {}
    for param, value in sources.items():
        assert param in held, f"SGLang has no parameter {param}"
        dtype, shape = held[param]
        if list(value.shape) != shape and param in ("model.embed_tokens.weight", "lm_head.weight"):
            # SGLang pads the vocabulary to a multiple of 64 rows; the rows past it are never loaded
            notes[param] = f"first {value.shape[0]} of {shape[0]} rows (vocabulary padded by SGLang)"
        else:
            assert list(value.shape) == shape, (
                f"{param}: SGLang holds {shape}, the push sends {list(value.shape)}"
            )
        expected[param] = value.to(getattr(torch, dtype))
    return expected, notes
