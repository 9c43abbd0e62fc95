"""The release's config.json keys beside transformers': derived from the same settings, the same layers for
the tiny model and DeepSeek-V4-Flash, written by every writer, and a directory where they disagree refused."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest
from transformers import DeepseekV4Config

from dsv4rl.config.choices import QuantMode
from dsv4rl.config.model_schema import ModelConfig, TinyModelConfig
from dsv4rl.config.schema import QuantConfig
from dsv4rl.model.model_dir import ModelDirMismatch, check_model_dir, materialize_model
from dsv4rl.model.native_checkpoint import CheckpointError, load_hf_config, load_native_model
from dsv4rl.model.release_config import (
    RELEASE_KEYS,
    SGLANG_SLIDING_WINDOW,
    LayerSchedule,
    ReleaseConfigError,
    check_release_keys,
    release_key_problems,
    release_keys,
    sglang_problems,
    sglang_schedule,
    tiny_transformers_keys,
    transformers_schedule,
    with_release_keys,
)
from dsv4rl.model.tiny import tiny_hf_config

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
# The layer keys of https://huggingface.co/deepseek-ai/DeepSeek-V4-Flash/blob/main/config.json (the last
# compress ratio is its MTP layer's); the shapes are recipes/model/deepseek_v4_flash.yaml's.
FLASH_RELEASE = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "num_hidden_layers": 43,
    "hidden_size": 4096,
    "vocab_size": 129280,
    "num_attention_heads": 64,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 6,
    "hc_mult": 4,
    "max_position_embeddings": 1048576,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    "num_hash_layers": 3,
    "sliding_window": 128,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "type": "yarn",
    },
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
}
# The tiny model with the settings SGLang can serve (launch/gpu_check.sh's).
SERVABLE_TINY = replace(TinyModelConfig(), hca_compress_rate=128, sliding_window=128)


def transformers_config(tiny: TinyModelConfig) -> dict:
    return tiny_hf_config(tiny, vocab_size=27).to_dict()


def kinds(schedule: LayerSchedule) -> list[tuple[str, int, bool]]:
    return list(zip(schedule.attention, schedule.compress_ratios, schedule.hash_routed, strict=True))


# ----------------------------------------------------------------------------- the same layers
def test_tiny_release_keys_state_the_tiny_models_ratios_and_hash_layers():
    config = transformers_config(TinyModelConfig())
    keys = release_keys(config, "float32")
    assert keys["compress_ratios"] == [0, 4, 4] and keys["num_hash_layers"] == 1
    assert (keys["sliding_window"], keys["torch_dtype"], keys["topk_method"]) == (8, "float32", "noaux_tc")
    # plain RoPE on the compressed layers: YaRN of factor 1, which SGLang computes as unscaled RoPE
    assert keys["rope_scaling"] == {
        "beta_fast": 32, "beta_slow": 1, "factor": 1, "original_max_position_embeddings": 1024,
        "type": "yarn",
    }  # fmt: skip
    ours = transformers_schedule(config)
    assert kinds(ours) == [(SLIDING, 0, True), (CSA, 4, False), (HCA, 4, False)]
    released = {**config, **keys}
    assert release_key_problems(released) == []  # the two key sets agree value for value
    # ...but the release's readers tell HCA by ratio 128: the tiny HCA layer at ratio 4 and its 8-token
    # window are what SGLang cannot serve, and are named
    served = sglang_schedule(released)
    assert kinds(served) == [(SLIDING, 0, True), (CSA, 4, False), (CSA, 4, False)]
    assert served.sliding_window == SGLANG_SLIDING_WINDOW
    problems = sglang_problems(released)
    assert len(problems) == 2 and problems[0].startswith("layer 2: heavily_compressed_attention (ratio 4)")
    assert "sliding window 8 vs 128" in problems[1]


def test_servable_tiny_settings_give_sglang_the_same_layers():
    config = {**transformers_config(SERVABLE_TINY), **release_keys(transformers_config(SERVABLE_TINY))}
    assert kinds(transformers_schedule(config)) == [(SLIDING, 0, True), (CSA, 4, False), (HCA, 128, False)]
    assert sglang_schedule(config) == transformers_schedule(config)
    assert sglang_problems(config) == []


def test_the_recipe_keys_give_the_built_configs_schedule():
    """`tiny_transformers_keys` (the launcher's, without torch) reads as tiny_hf_config's DeepseekV4Config."""
    for tiny in (TinyModelConfig(), SERVABLE_TINY):
        keys = tiny_transformers_keys(tiny)
        assert transformers_schedule(keys) == transformers_schedule(transformers_config(tiny))
        assert release_keys(keys)["rope_scaling"] == release_keys(transformers_config(tiny))["rope_scaling"]


def test_flash_release_keys_round_trip_through_transformers():
    """transformers reads the release's Flash keys into its own; the release keys derived back from those are
    the release's (its MTP layer's trailing ratio aside), and every reader sees the same layers."""
    hf = DeepseekV4Config.from_dict(copy.deepcopy(FLASH_RELEASE)).to_dict()  # it fills rope_scaling in
    ours = transformers_schedule(hf)
    assert ours.attention[:4] == (SLIDING, SLIDING, CSA, HCA) and ours.attention[-1] == CSA
    assert [layer for layer, hashed in enumerate(ours.hash_routed) if hashed] == [0, 1, 2]
    assert hf["rope_parameters"]["compress"]["rope_type"] == "yarn"
    keys = release_keys(hf)
    assert keys["compress_ratios"] == FLASH_RELEASE["compress_ratios"][:43]
    for key in ("num_hash_layers", "sliding_window", "rope_scaling", "topk_method", "torch_dtype"):
        assert keys[key] == FLASH_RELEASE[key], key
    assert transformers_schedule(FLASH_RELEASE) == ours == sglang_schedule(FLASH_RELEASE)
    assert sglang_problems(FLASH_RELEASE) == [] and sglang_problems({**hf, **keys}) == []
    assert release_key_problems({**hf, **keys}) == []


def test_a_model_the_release_keys_cannot_state_is_refused():
    config = transformers_config(replace(TinyModelConfig(), mlp_layer_types=["moe", "hash_moe", "moe"]))
    with pytest.raises(ReleaseConfigError, match="hash_moe layers must come first"):
        release_keys(config)


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("compress_ratios", [0, 4, 128], "compress_ratios[2]=128 but layer_types[2]=heavily_compressed"),
        ("num_hash_layers", 0, "num_hash_layers=0 routes layers [] by hash but mlp_layer_types routes [0]"),
        ("torch_dtype", "bfloat16", "dtype=float32 but torch_dtype=bfloat16"),
        (
            "rope_scaling",
            {"type": "yarn", "factor": 16, "original_max_position_embeddings": 1024},
            "factor=16",
        ),
        ("topk_method", "greedy", "topk_method='greedy'"),
        ("compress_rope_theta", 40000, "compress_rope_theta=40000 but rope_parameters.compress.rope_theta"),
    ],
)
def test_each_disagreement_is_named(key, value, named):
    config = with_release_keys(transformers_config(TinyModelConfig()), "float32")
    check_release_keys(config, "ok")
    with pytest.raises(ReleaseConfigError, match="state different models") as refused:
        check_release_keys({**config, key: value}, "edited")
    assert named in str(refused.value)


# ----------------------------------------------------------------------------- written directories
@pytest.mark.parametrize(("quant", "dtype"), [(QuantMode.none, "float32"), (QuantMode.bf16, "bfloat16")])
def test_the_tiny_model_directory_carries_agreeing_release_keys(tmp_path, quant, dtype):
    directory = Path(materialize_model(ModelConfig(), str(tmp_path / "m"), QuantConfig(name=quant)))
    config = json.loads((directory / "config.json").read_text())
    assert set(RELEASE_KEYS) <= config.keys() and config["torch_dtype"] == config["dtype"] == dtype
    assert release_key_problems(config) == []
    built = transformers_config(TinyModelConfig())
    assert transformers_schedule(config) == transformers_schedule(built)
    assert config["compress_ratios"] == [0, 4, 4] and config["num_hash_layers"] == 1
    # transformers still reads its own keys: the release's rope_scaling does not replace rope_parameters
    loaded = load_hf_config(directory)
    assert loaded.rope_parameters == tiny_hf_config(TinyModelConfig(), 27).rope_parameters
    assert (loaded.layer_types, loaded.mlp_layer_types) == (built["layer_types"], built["mlp_layer_types"])


def _edit(directory: Path, **changes) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def test_a_directory_whose_keys_disagree_is_refused(tmp_path):
    directory = Path(materialize_model(ModelConfig(), str(tmp_path / "m")))
    _edit(directory, num_hash_layers=0)
    with pytest.raises(CheckpointError, match=r"num_hash_layers=0 .* mlp_layer_types routes \[0\]"):
        load_native_model(directory)
    with pytest.raises(ModelDirMismatch, match="num_hash_layers=0"):
        check_model_dir(ModelConfig(), directory, QuantConfig())


def test_a_directory_without_the_release_keys_is_rebuilt_not_reused(tmp_path):
    directory = Path(materialize_model(ModelConfig(), str(tmp_path / "m")))
    _edit(directory, compress_ratios=None, num_hash_layers=None)
    load_native_model(directory)  # transformers' keys alone still load (the reference engine's reading)
    with pytest.raises(ModelDirMismatch, match=r"lacks the release's keys \['compress_ratios', 'num_hash"):
        materialize_model(ModelConfig(), str(directory))
