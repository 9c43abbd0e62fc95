"""Validation of the release's config keys: the tiny model's settings against what SGLang can build from
them, and a model directory whose two key sets disagree (`dsv4rl.model.release_config`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dsv4rl.checks import machine
from dsv4rl.checks.run import check_model
from dsv4rl.config.choices import RolloutEngineKind
from dsv4rl.config.compose import compose
from dsv4rl.config.model_schema import ModelConfig
from dsv4rl.config.schema import Config
from dsv4rl.model.model_dir import materialize_model


@pytest.fixture
def tiny() -> Config:
    return compose("tiny_arith")


def model_problems(cfg: Config) -> list[str]:
    found: list[str] = []
    check_model(cfg, found.append)
    return found


def test_the_tiny_model_for_sglang_needs_the_layers_sglang_builds(tiny: Config) -> None:
    assert model_problems(tiny) == []  # the reference engine reads transformers' keys
    tiny.parallel.rollout.engine = RolloutEngineKind.sglang
    found = model_problems(tiny)
    assert len(found) == 2, found
    assert "layer 2: heavily_compressed_attention (ratio 4) vs compressed_sparse_attention" in found[0]
    assert "sliding window 8 vs 128" in found[1]
    assert all("model.tiny.hca_compress_rate=128" in p and "engine=reference" in p for p in found)
    tiny.model.tiny.hca_compress_rate = tiny.model.tiny.sliding_window = 128
    assert model_problems(tiny) == []


def test_hash_routed_layers_after_a_score_routed_one_are_refused(tiny: Config) -> None:
    tiny.model.tiny.mlp_layer_types = ["moe", "hash_moe", "moe"]
    (found,) = model_problems(tiny)
    assert found.startswith("model.tiny:") and "hash_moe layers must come first" in found


def test_a_model_directory_whose_keys_disagree_is_refused(tiny: Config, tmp_path: Path) -> None:
    directory = Path(materialize_model(ModelConfig(), str(tmp_path / "m")))
    tiny.model.path = str(directory)
    found: list[str] = []
    machine.check_model_layout(tiny, found.append)
    assert found == []
    config = json.loads((directory / "config.json").read_text())
    config["compress_ratios"] = [0, 4, 128]
    (directory / "config.json").write_text(json.dumps(config))
    machine.check_model_layout(tiny, found.append)
    (problem,) = found
    assert "compress_ratios[2]=128 but layer_types[2]=heavily_compressed_attention" in problem
    assert str(directory) in problem and "delete the directory" in problem


def test_a_release_directory_is_read_as_the_release_states_it(tiny: Config, tmp_path: Path) -> None:
    """Only the release's keys (DeepSeek-V4-Flash's config.json): nothing to disagree, SGLang builds it."""
    (tmp_path / "config.json").write_text(
        json.dumps({
            "num_hidden_layers": 4, "compress_ratios": [0, 0, 4, 128, 0], "num_hash_layers": 3,
            "sliding_window": 128, "topk_method": "noaux_tc",
            "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536},
        })
    )  # fmt: skip
    tiny.model.path = str(tmp_path)
    tiny.parallel.rollout.engine = RolloutEngineKind.sglang
    found: list[str] = []
    machine.check_model_layout(tiny, found.append)
    assert found == []


def v41_config() -> dict:
    """A DeepSeek-V4.1 config.json as its release nests it (SGLang 0.5.23 reads it through
    srt/configs/deepseek_v41.py): the text model under `text_config`, V4.1's own keys beside V4's."""
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "text_config": {
            "model_type": "deepseek_v41_text",
            "hidden_size": 64,
            "num_hidden_layers": 5,
            "compress_ratios": [0, 2, 2, 1, 1],
            "kv_source_layer_ids": [1, 3],
            "index_source_layer_ids": [1],
            "engram_layer_ids": [1],
            "hc_pre_from_prev_sublayer": True,
        },
        "vision_config": {"model_type": "deepseek_v41_vision"},
    }


@pytest.mark.parametrize(
    ("config", "named"),
    [
        (v41_config(), "holds DeepSeek-V4.1 (model_type 'deepseek_v41')"),
        ({**v41_config(), "architectures": None, "model_type": None}, "holds DeepSeek-V4.1"),  # text_config's
        ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, "model_type is 'llama', not"),
    ],
)
def test_a_model_directory_of_another_model_is_refused_before_any_process(
    tiny: Config, tmp_path: Path, config: dict, named: str
) -> None:
    """A DeepSeek-V4.1 checkpoint (or any other model) given as model.path is refused by validation, with
    what differs and the fix, instead of failing inside the trainer's load."""
    from dsv4rl.checks.validate import validate
    from dsv4rl.config.compose import ConfigError

    directory = Path(materialize_model(ModelConfig(), str(tmp_path / "m")))
    (directory / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    cfg = compose("tiny_arith", [f"model.path={directory}"])
    with pytest.raises(ConfigError, match=re.escape(named)) as refused:
        validate(cfg)
    assert "point model.path at a DeepSeek-V4 checkpoint" in str(refused.value)
    assert "compress_ratios[" not in str(refused.value)  # V4's key checks do not read another model's keys
