"""Which expert module each configuration builds: Transformer Engine's grouped GEMM where it imports (GPU
runs), megatron's SequentialMLP otherwise; and both name their tensors onto the same transformers ones."""

from __future__ import annotations

import pytest
from megatron.core.extensions import transformer_engine
from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP

from dsv4rl.config.model_schema import TinyModelConfig
from dsv4rl.model.tiny import tiny_hf_config
from dsv4rl.train.megatron import architecture, moe
from dsv4rl.train.megatron.architecture import DeepseekV4Architecture, ParallelSizes, transformer_config
from dsv4rl.train.megatron.convert import Ranks, placement


class _GroupedFc1:  # stand-ins for TE's grouped linears (Transformer Engine is not installed on CPU)
    pass


class _GroupedFc2:
    pass


@pytest.fixture
def with_grouped_linears(monkeypatch):
    monkeypatch.setattr(transformer_engine, "TEColumnParallelGroupedLinear", _GroupedFc1)
    monkeypatch.setattr(transformer_engine, "TERowParallelGroupedLinear", _GroupedFc2)


def test_without_transformer_engine_the_experts_are_sequential():
    assert not moe.grouped_experts_available()  # this machine: no Transformer Engine
    spec = moe.moe_spec(hash_routed=False, vocab_size=64, route_scale=1.5)
    assert spec.submodules.experts.module is SequentialMLP
    with pytest.raises(RuntimeError, match="Transformer Engine"):
        moe.moe_spec(hash_routed=False, vocab_size=64, route_scale=1.5, grouped=True)


def test_with_transformer_engine_the_experts_are_one_grouped_gemm(with_grouped_linears):
    assert moe.grouped_experts_available()
    for hash_routed in (False, True):
        spec = moe.moe_spec(hash_routed=hash_routed, vocab_size=64, route_scale=1.5, grouped=True)
        experts = spec.submodules.experts
        assert experts.module is TEGroupedMLP
        assert (experts.submodules.linear_fc1, experts.submodules.linear_fc2) == (_GroupedFc1, _GroupedFc2)
        router = spec.submodules.router.func
        assert router is (moe.HashRouter if hash_routed else moe.ScoreRouter)


def test_the_megatron_config_asks_for_grouped_gemm_on_gpus_with_transformer_engine(monkeypatch):
    arch = DeepseekV4Architecture.from_hf(tiny_hf_config(TinyModelConfig(), vocab_size=64))
    assert not transformer_config(
        arch, ParallelSizes(), architecture.torch.float32, on_cpu=True
    ).moe_grouped_gemm
    monkeypatch.setattr(architecture, "grouped_experts_available", lambda: True)
    assert not transformer_config(
        arch, ParallelSizes(), architecture.torch.float32, on_cpu=True
    ).moe_grouped_gemm
    config = transformer_config(arch, ParallelSizes(), architecture.torch.float32, on_cpu=False)
    assert config.moe_grouped_gemm


@pytest.mark.parametrize("expert_rank", [0, 1])
def test_grouped_and_sequential_expert_names_map_to_the_same_tensors(expert_rank):
    ranks = Ranks(expert=expert_rank, expert_size=2, layer_offset=3)
    for fc in ("linear_fc1", "linear_fc2"):
        for local in range(4):
            sequential = placement(
                f"decoder.layers.1.mlp.experts.local_experts.{local}.{fc}.weight", ranks, 8
            )
            grouped = placement(f"decoder.layers.1.mlp.experts.{fc}.weight{local}", ranks, 8)
            assert grouped == sequential
            assert grouped.expert == expert_rank * 4 + local and grouped.hf_names[0].startswith(
                "model.layers.4."
            )
