from __future__ import annotations

import pytest
import torch

from dsv4rl.config.model_schema import ModelConfig
from dsv4rl.model.naming import (
    UnknownTensorName,
    copy_native_into,
    hf_to_native,
    native_slot,
    state_dict_to_native,
)
from dsv4rl.model.tiny import load_model


@pytest.fixture(scope="module")
def state() -> dict[str, torch.Tensor]:
    return load_model(ModelConfig()).state_dict()


def test_native_names_of_the_checkpoint(state) -> None:
    names = dict(state_dict_to_native(state))
    for expected in (
        "embed.weight",
        "head.weight",
        "norm.weight",
        "hc_head_fn",
        "layers.0.attn.attn_sink",
        "layers.0.attn.wq_a.weight",
        "layers.0.attn.kv_norm.weight",
        "layers.0.ffn.gate.tid2eid",
        "layers.1.attn.compressor.ape",
        "layers.1.attn.indexer.compressor.wkv.weight",
        "layers.1.attn.indexer.weights_proj.weight",
        "layers.2.ffn.gate.bias",
        "layers.2.ffn.experts.7.w3.weight",
        "layers.2.hc_ffn_scale",
    ):
        assert expected in names, expected
    # 8 experts x (w1, w2, w3) replace the 2 fused tensors in each of the 3 layers.
    assert len(names) == len(state) + 3 * (3 * 8 - 2)


def test_experts_split_without_transpose(state) -> None:
    gate_up = state["model.layers.1.mlp.experts.gate_up_proj"]
    down = state["model.layers.1.mlp.experts.down_proj"]
    names = dict(hf_to_native("model.layers.1.mlp.experts.gate_up_proj", gate_up))
    half = gate_up.shape[1] // 2
    assert torch.equal(names["layers.1.ffn.experts.3.w1.weight"], gate_up[3, :half])
    assert torch.equal(names["layers.1.ffn.experts.3.w3.weight"], gate_up[3, half:])
    assert torch.equal(
        dict(hf_to_native("model.layers.1.mlp.experts.down_proj", down))["layers.1.ffn.experts.3.w2.weight"],
        down[3],
    )


def test_round_trip_into_a_model_with_other_weights(state) -> None:
    target = {
        name: tensor.clone() for name, tensor in load_model(ModelConfig(init_seed=9)).state_dict().items()
    }
    for name, tensor in state_dict_to_native(state):
        copy_native_into(target, name, tensor)
    for name, tensor in state.items():
        assert torch.equal(target[name], tensor), name


def test_slots_of_native_names() -> None:
    assert native_slot("layers.2.ffn.experts.5.w1.weight").expert == 5
    assert native_slot("layers.2.ffn.experts.5.w2.weight").part == "down"
    assert native_slot("layers.0.ffn.gate.tid2eid").hf_name == "model.layers.0.mlp.gate.tid2eid"


@pytest.mark.parametrize(
    "name", ["layers.0.attn.nonsense", "model.layers.0.self_attn.q_a_proj.weight", "mtp.0.e_proj"]
)
def test_unknown_native_names_are_refused(name) -> None:
    with pytest.raises(UnknownTensorName, match="native tensor name"):
        native_slot(name)


def test_copy_checks_shape_and_integer_kind(state) -> None:
    target = {name: tensor.clone() for name, tensor in state.items()}
    with pytest.raises(ValueError, match="does not match"):
        copy_native_into(target, "norm.weight", torch.zeros(3))
    with pytest.raises(ValueError, match="cannot be loaded"):
        copy_native_into(
            target, "layers.0.ffn.gate.tid2eid", state["model.layers.0.mlp.gate.tid2eid"].float()
        )
