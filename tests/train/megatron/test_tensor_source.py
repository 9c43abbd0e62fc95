"""Each Megatron rank reads only its own tensors from a native checkpoint: what it reads, tensor by
tensor (dequantized), equals the transformers model loaded whole from the same checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsv4rl.config.choices import QuantMode
from dsv4rl.config.model_schema import ModelConfig
from dsv4rl.config.schema import QuantConfig
from dsv4rl.model.model_dir import materialize_model
from dsv4rl.model.native_checkpoint import load_native_model
from dsv4rl.train.megatron.tensor_source import NativeCheckpointSource, StateDictSource


@pytest.mark.parametrize("mode", [QuantMode.none, QuantMode.fp8_mxfp4])
def test_native_source_reads_what_the_whole_model_holds(tmp_path: Path, mode: QuantMode) -> None:
    directory = tmp_path / mode.value
    materialize_model(ModelConfig(), str(directory), QuantConfig(name=mode))
    state = load_native_model(directory).state_dict()
    native, whole = NativeCheckpointSource(directory), StateDictSource(state)
    for name, tensor in state.items():
        if name.endswith(("gate_up_proj", "down_proj")) and ".experts." in name:
            for index in range(tensor.shape[0]):
                assert torch.equal(native.expert(name, index), whole.expert(name, index)), (name, index)
        else:
            read = native.whole(name)
            assert read.dtype == tensor.dtype and torch.equal(read, tensor), name


def test_a_missing_tensor_is_named(tmp_path: Path) -> None:
    materialize_model(ModelConfig(), str(tmp_path))
    with pytest.raises(KeyError, match="layers.7.attn.wq_a.weight"):
        NativeCheckpointSource(tmp_path).whole("model.layers.7.self_attn.q_a_proj.weight")
