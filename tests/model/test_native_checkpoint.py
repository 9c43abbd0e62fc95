"""Native checkpoints: the release's names, dtypes, shapes and quantization_config; round trips; refusals."""

import json

import pytest
import torch
from safetensors.torch import save_file

from dsv4rl.config.choices import QuantMode
from dsv4rl.config.model_schema import ModelConfig
from dsv4rl.config.schema import QuantConfig
from dsv4rl.model.model_dir import ModelDirMismatch, materialize_model
from dsv4rl.model.naming import state_dict_to_native
from dsv4rl.model.native_checkpoint import (
    CheckpointError,
    checkpoint_format,
    is_native_checkpoint,
    load_native_model,
    read_tensors,
    tensor_dtypes,
    write_native_checkpoint,
)
from dsv4rl.model.tiny import build_tiny_model
from dsv4rl.model.wire_format import WireFormat
from dsv4rl.quant.fp8 import E4M3
from dsv4rl.quant.scales import E8M0

RELEASE_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
    "activation_scheme": "dynamic",
}


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_tiny_model(ModelConfig(init_seed=5), 27)


def test_release_layout(model, tmp_path):
    path = write_native_checkpoint(model, tmp_path / "ckpt", WireFormat(QuantMode.fp8_mxfp4))
    config = json.loads((path / "config.json").read_text())
    assert config["quantization_config"] == RELEASE_CONFIG
    assert config["architectures"] == ["DeepseekV4ForCausalLM"] and config["model_type"] == "deepseek_v4"
    dtypes = tensor_dtypes(path)
    assert (
        dtypes["embed.weight"]
        == dtypes["head.weight"]
        == dtypes["layers.0.attn_norm.weight"]
        == torch.bfloat16
    )
    assert dtypes["layers.0.attn.wq_a.weight"] == E4M3 and dtypes["layers.0.attn.wq_a.scale"] == E8M0
    assert dtypes["layers.1.ffn.experts.5.w2.weight"] == torch.int8
    assert dtypes["layers.1.ffn.experts.5.w2.scale"] == E8M0
    assert dtypes["layers.0.ffn.gate.tid2eid"] == torch.int64 and dtypes["hc_head_fn"] == torch.float32
    native = {name for name, _ in state_dict_to_native(model.state_dict())}
    scales = {n for n in dtypes if n.endswith(".scale")}
    assert set(dtypes) - scales == native
    assert all(n.removesuffix(".scale") + ".weight" in native for n in scales)
    assert is_native_checkpoint(path)


@pytest.mark.parametrize("mode", list(QuantMode))
def test_round_trip_native_trainer_native_keeps_the_values(model, tmp_path, mode):
    """The trainer dequantizes a checkpoint; writing its weights again gives the same values (idempotent)."""
    first = write_native_checkpoint(model, tmp_path / "first", WireFormat(mode))
    fmt = checkpoint_format(first)
    assert fmt.mode == mode
    trainer = load_native_model(first)
    assert all(t.dtype in (torch.float32, torch.int64) for t in trainer.state_dict().values())
    second = write_native_checkpoint(trainer, tmp_path / "second", WireFormat(mode))
    again = load_native_model(second)
    for (name, a), (_, b) in zip(trainer.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    if mode == QuantMode.none:  # no quantization at all: the original bits
        assert all(torch.equal(a, trainer.state_dict()[n]) for n, a in model.state_dict().items())
    ids = torch.tensor([[0, 3, 4, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        diff = (model(ids).logits.log_softmax(-1) - trainer(ids).logits.log_softmax(-1)).abs().max()
    assert diff < {QuantMode.none: 1e-6, QuantMode.bf16: 1e-2}.get(mode, 0.1)


def test_checkpoint_format_describes_and_classifies(model, tmp_path):
    fmt = checkpoint_format(write_native_checkpoint(model, tmp_path / "a", WireFormat(QuantMode.fp8_rollout)))
    assert (fmt.mode, fmt.experts, fmt.expert_scale_dtype, fmt.block) == (
        QuantMode.fp8_rollout, "fp8", E8M0, (128, 128),
    )  # fmt: skip
    assert "fp8_rollout" in fmt.describe() and "float8_e4m3fn" in fmt.describe()
    f32 = write_native_checkpoint(
        model, tmp_path / "b", WireFormat(QuantMode.fp8_mxfp4, expert_scale_dtype=torch.float32)
    )
    assert checkpoint_format(f32).expert_scale_dtype == torch.float32
    with pytest.raises(CheckpointError, match="no safetensors"):
        checkpoint_format(tmp_path)


def test_loading_refuses_missing_and_unknown_tensors(model, tmp_path):
    path = write_native_checkpoint(model, tmp_path / "c", WireFormat(QuantMode.none))
    tensors = read_tensors(path)
    tensors.pop("layers.1.attn.wq_b.weight")
    tensors["layers.9.attn_norm.weight"] = torch.ones(64)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"1 tensors missing \['layers.1.attn.wq_b.weight'\]"):
        load_native_model(path)


def test_sharded_checkpoints_are_read_through_the_index(model, tmp_path):
    path = write_native_checkpoint(model, tmp_path / "d", WireFormat(QuantMode.bf16))
    tensors = read_tensors(path)
    names = sorted(tensors)
    halves = {"model-00001.safetensors": names[::2], "model-00002.safetensors": names[1::2]}
    for shard, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(path / shard))
    (path / "model.safetensors").unlink()
    index = {"weight_map": {k: shard for shard, keys in halves.items() for k in keys}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert checkpoint_format(path).mode == QuantMode.bf16
    assert torch.equal(load_native_model(path).lm_head.weight, load_native_model(path).lm_head.weight)
    assert set(read_tensors(path)) == set(names)


def test_a_transformers_directory_still_loads(model, tmp_path):
    model.save_pretrained(tmp_path / "hf")
    assert not is_native_checkpoint(tmp_path / "hf")
    loaded = load_native_model(tmp_path / "hf")
    assert all(torch.equal(a, loaded.state_dict()[n]) for n, a in model.state_dict().items())


def test_materialize_reuses_only_the_same_settings(tmp_path):
    path = materialize_model(ModelConfig(), str(tmp_path / "m"), QuantConfig(name=QuantMode.fp8_mxfp4))
    assert checkpoint_format(path).mode == QuantMode.fp8_mxfp4
    assert (tmp_path / "m" / "tokenizer.json").exists()
    assert materialize_model(ModelConfig(), path, QuantConfig(name=QuantMode.fp8_mxfp4)) == path
    with pytest.raises(ModelDirMismatch, match="quant=none"):
        materialize_model(ModelConfig(), path, QuantConfig())
    with pytest.raises(ModelDirMismatch):
        materialize_model(ModelConfig(init_seed=3), path, QuantConfig(name=QuantMode.fp8_mxfp4))
