"""Which native tensor each quant mode sends in which format: the release's table, on the tiny model."""

import pytest
import torch

from dsv4rl.config.choices import QuantMode
from dsv4rl.config.model_schema import ModelConfig
from dsv4rl.model.naming import CheckpointKind, checkpoint_kind, state_dict_to_native
from dsv4rl.model.tiny import build_tiny_model
from dsv4rl.model.wire_format import WireFormat
from dsv4rl.quant.formats import dequantize
from dsv4rl.quant.fp8 import E4M3
from dsv4rl.quant.scales import E8M0

KINDS = {
    "embed.weight": CheckpointKind.bf16,
    "head.weight": CheckpointKind.bf16,
    "norm.weight": CheckpointKind.bf16,
    "hc_head_fn": CheckpointKind.fp32,
    "hc_head_scale": CheckpointKind.fp32,
    "layers.0.hc_attn_base": CheckpointKind.fp32,
    "layers.0.attn.attn_sink": CheckpointKind.fp32,
    "layers.0.attn.wq_a.weight": CheckpointKind.fp8_linear,
    "layers.0.attn.q_norm.weight": CheckpointKind.bf16,
    "layers.0.attn.wq_b.weight": CheckpointKind.fp8_linear,
    "layers.0.attn.wkv.weight": CheckpointKind.fp8_linear,
    "layers.0.attn.wo_a.weight": CheckpointKind.fp8_linear,
    "layers.0.attn.wo_b.weight": CheckpointKind.fp8_linear,
    "layers.1.attn.compressor.wkv.weight": CheckpointKind.bf16,
    "layers.1.attn.compressor.ape": CheckpointKind.fp32,
    "layers.1.attn.indexer.wq_b.weight": CheckpointKind.fp8_linear,
    "layers.1.attn.indexer.weights_proj.weight": CheckpointKind.bf16,
    "layers.1.attn.indexer.compressor.ape": CheckpointKind.fp32,
    "layers.1.attn.indexer.compressor.wgate.weight": CheckpointKind.bf16,
    "layers.1.ffn.gate.weight": CheckpointKind.bf16,
    "layers.1.ffn.gate.bias": CheckpointKind.fp32,
    "layers.0.ffn.gate.tid2eid": CheckpointKind.integer,
    "layers.1.ffn.shared_experts.w2.weight": CheckpointKind.fp8_linear,
    "layers.1.ffn.experts.7.w3.weight": CheckpointKind.routed_expert,
    "layers.0.attn_norm.weight": CheckpointKind.bf16,
}


def test_checkpoint_kinds_follow_the_release():
    assert {name: checkpoint_kind(name) for name in KINDS} == KINDS


@pytest.fixture(scope="module")
def native() -> dict[str, torch.Tensor]:
    model = build_tiny_model(ModelConfig(), 27)
    return {name: t.detach().clone() for name, t in state_dict_to_native(model.state_dict())}


# (kind -> (weight dtype, scale dtype or None)) per mode
EXPECTED = {
    QuantMode.bf16: {
        CheckpointKind.fp8_linear: (torch.bfloat16, None),
        CheckpointKind.routed_expert: (torch.bfloat16, None),
    },
    QuantMode.fp8_rollout: {
        CheckpointKind.fp8_linear: (E4M3, E8M0),
        CheckpointKind.routed_expert: (E4M3, E8M0),
    },
    QuantMode.fp8_mxfp4: {
        CheckpointKind.fp8_linear: (E4M3, E8M0),
        CheckpointKind.routed_expert: (torch.int8, E8M0),
    },
}


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_every_tensor_travels_in_its_release_format(native, mode):
    wire = WireFormat(mode)
    for name, tensor in native.items():
        kind = checkpoint_kind(name)
        encoded = dict(wire.encode(name, tensor))
        if kind in EXPECTED[mode]:
            dtype, scale_dtype = EXPECTED[mode][kind]
            assert encoded[name].dtype == dtype, name
            scale = encoded.get(name.removesuffix(".weight") + ".scale")
            assert (scale.dtype if scale is not None else None) == scale_dtype, name
        else:  # never quantized: norms, router, mHC, sinks, position biases, embed, head, tid2eid
            assert list(encoded) == [name]
            expected = {CheckpointKind.bf16: torch.bfloat16, CheckpointKind.fp32: torch.float32,
                        CheckpointKind.integer: torch.int64}[kind]  # fmt: skip
            assert encoded[name].dtype == expected, name
    # shapes: packed experts halve the input dimension; scales per 128x128 tile or per 1x32 block
    w1 = dict(wire.encode("layers.1.ffn.experts.0.w1.weight", native["layers.1.ffn.experts.0.w1.weight"]))
    if mode == QuantMode.fp8_mxfp4:
        assert w1["layers.1.ffn.experts.0.w1.weight"].shape == (32, 32)
        assert w1["layers.1.ffn.experts.0.w1.scale"].shape == (32, 2)
    elif mode == QuantMode.fp8_rollout:
        assert w1["layers.1.ffn.experts.0.w1.scale"].shape == (1, 1)


def test_none_sends_the_trainer_tensors_unchanged(native):
    wire = WireFormat(QuantMode.none)
    for name, tensor in native.items():
        assert wire.encode(name, tensor) == [(name, tensor)]


def test_expert_scales_follow_the_engine(native):
    name = "layers.1.ffn.experts.0.w2.weight"
    for mode in (QuantMode.fp8_rollout, QuantMode.fp8_mxfp4):
        encoded = dict(WireFormat(mode, expert_scale_dtype=torch.float32).encode(name, native[name]))
        assert encoded["layers.1.ffn.experts.0.w2.scale"].dtype == torch.float32
    linear = dict(WireFormat(QuantMode.fp8_mxfp4, expert_scale_dtype=torch.float32).encode(
        "layers.0.attn.wq_a.weight", native["layers.0.attn.wq_a.weight"]))  # fmt: skip
    assert linear["layers.0.attn.wq_a.scale"].dtype == E8M0  # linears keep the checkpoint's E8M0
    with pytest.raises(ValueError, match="float8_e8m0fnu or float32"):
        WireFormat(QuantMode.fp8_mxfp4, expert_scale_dtype=torch.bfloat16)


def test_dequantize_dispatches_on_dtype(native):
    for mode in (QuantMode.fp8_rollout, QuantMode.fp8_mxfp4):
        for name in ("layers.1.attn.wq_b.weight", "layers.2.ffn.experts.3.w1.weight"):
            weight, scale = (t for _, t in WireFormat(mode).encode(name, native[name]))
            values = dequantize(weight, scale)
            assert values.dtype == torch.float32 and values.shape == native[name].shape
            assert (values - native[name]).abs().max() <= native[name].abs().max() * 0.3
    assert dequantize(native["norm.weight"].bfloat16(), None).dtype == torch.float32
    assert dequantize(native["layers.0.ffn.gate.tid2eid"], None).dtype == torch.int64
    with pytest.raises(ValueError, match="needs its scale"):
        dequantize(torch.zeros(2, 2, dtype=torch.int8), None)
    with pytest.raises(ValueError, match="no scale"):
        dequantize(torch.zeros(2, 2), torch.ones(1, 1))
