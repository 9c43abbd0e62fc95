"""HeldWeights: what an update must look like to be accepted, and what a commit does to the forward model."""

from __future__ import annotations

import pytest
import torch

from dsv4rl.config.choices import QuantMode
from dsv4rl.config.model_schema import ModelConfig
from dsv4rl.engine.weight_store import DeepseekWeights, HeldWeights
from dsv4rl.model.naming import native_slot, slot_view, state_dict_to_native
from dsv4rl.model.native_checkpoint import dequantized_native_state, load_native_state
from dsv4rl.model.tiny import build_tiny_model
from dsv4rl.model.wire_format import WireFormat

NAME = "layers.1.ffn.experts.2.w2.weight"


def encoded(model: torch.nn.Module, mode: QuantMode) -> dict[str, torch.Tensor]:
    return WireFormat(mode).encode_all(state_dict_to_native(model.state_dict()))


@pytest.fixture
def weights() -> DeepseekWeights:
    model = build_tiny_model(ModelConfig(init_seed=1), 27)
    stored = encoded(model, QuantMode.fp8_mxfp4)
    load_native_state(model, dequantized_native_state(stored, (128, 128)))
    return DeepseekWeights(model, stored, (128, 128), served="fp8_mxfp4")


def test_plan_accepts_exactly_what_is_held(weights: DeepseekWeights) -> None:
    held = weights.state()
    names = [NAME, NAME.replace(".weight", ".scale")]
    plan = weights.plan(names, ["int8", "float8_e8m0fnu"], [list(held[n].shape) for n in names])
    assert [(p.name, p.dtype, p.shape) for p in plan] == [
        (NAME, torch.int8, (64, 16)),
        (names[1], torch.float8_e8m0fnu, (64, 1)),
    ]
    with pytest.raises(
        ValueError, match=r"holds int8 \[64, 16\] \(it serves fp8_mxfp4\), the request sends float32"
    ):
        weights.plan(names, ["float32", "float8_e8m0fnu"], [[64, 16], [64, 1]])
    with pytest.raises(ValueError, match="without layers.1.ffn.experts.2.w2.scale"):
        weights.plan([NAME], ["int8"], [[64, 16]])


def test_commit_dequantizes_into_the_forward_model(weights: DeepseekWeights) -> None:
    other = encoded(build_tiny_model(ModelConfig(init_seed=2), 27), QuantMode.fp8_mxfp4)
    scale = NAME.replace(".weight", ".scale")
    weights.commit({NAME: other[NAME].clone(), scale: other[scale].clone()})
    assert torch.equal(weights.state()[NAME], other[NAME])
    expected = dequantized_native_state({NAME: other[NAME], scale: other[scale]}, (128, 128))[NAME]
    assert torch.equal(slot_view(weights.model.state_dict(), native_slot(NAME)), expected)


def test_reset_random_skips_by_substring() -> None:
    held = HeldWeights({"a.weight": torch.zeros(4), "b.tid2eid": torch.zeros(4, dtype=torch.int64)})
    assert held.reset_random(skip=["tid2eid"]) == 1
    assert not torch.equal(held.state()["a.weight"], torch.zeros(4))
    assert torch.equal(held.state()["b.tid2eid"], torch.zeros(4, dtype=torch.int64))
