"""The connect-time check of what each engine serves against the recipe's model, on fake engine answers
shaped as SGLang 0.5.23's /model_info and /server_info."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dsv4rl.config.choices import RolloutEngineKind
from dsv4rl.config.model_schema import ModelConfig, TinyModelConfig
from dsv4rl.model.model_dir import materialize_model
from dsv4rl.sync.errors import WeightSyncError
from dsv4rl.sync.served_model import SGLANG_MODEL_INFO_KEYS, check_served_models, served_dtype

REFERENCE, SGLANG = RolloutEngineKind.reference, RolloutEngineKind.sglang
SERVABLE = ModelConfig(tiny=TinyModelConfig(hca_compress_rate=128, sliding_window=128))


@dataclass
class FakeEngine:
    """What an engine answers: SGLang's /model_info keys, and the /server_info fields the check reads."""

    model_path: str
    base_url: str = "http://engine-0"
    dtype: str = "auto"
    overrides: str = "{}"
    model_type: str = "deepseek_v4"
    info: dict = field(default_factory=dict)

    async def model_info(self) -> dict:
        answer = dict.fromkeys(SGLANG_MODEL_INFO_KEYS)
        answer.update(
            model_path=self.model_path, model_type=self.model_type, architectures=["DeepseekV4ForCausalLM"]
        )
        return answer

    async def server_info(self) -> dict:
        return {
            "model_path": self.model_path,
            "dtype": self.dtype,
            "json_model_override_args": self.overrides,
        }


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    event_loop = asyncio.new_event_loop()
    yield event_loop
    event_loop.close()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return materialize_model(ModelConfig(), str(tmp_path_factory.mktemp("served") / "tiny"))


@pytest.fixture(scope="module")
def servable_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return materialize_model(SERVABLE, str(tmp_path_factory.mktemp("served") / "servable"))


def refusal(engines: list[FakeEngine], kind: RolloutEngineKind, model_path: str, loop) -> str:
    with pytest.raises(WeightSyncError, match="the engines do not serve the recipe's model") as refused:
        check_served_models(engines, kind, model_path, loop)
    return str(refused.value)


def test_engines_serving_the_recipes_model_pass(tiny_dir, servable_dir, loop):
    check_served_models([FakeEngine(tiny_dir)], REFERENCE, tiny_dir, loop)
    check_served_models([FakeEngine(servable_dir, dtype="float32")], SGLANG, servable_dir, loop)


def test_sglang_with_dtype_auto_on_a_float32_checkpoint_is_stopped(servable_dir, loop):
    message = refusal([FakeEngine(servable_dir)], SGLANG, servable_dir, loop)
    assert "engine http://engine-0: it computes in float16 (launched with --dtype auto" in message
    assert "checkpoint dtype float32" in message and "--dtype float32 or bfloat16" in message


def test_sglang_on_the_default_tiny_model_builds_other_layers(tiny_dir, loop):
    message = refusal([FakeEngine(tiny_dir, dtype="bfloat16")], SGLANG, tiny_dir, loop)
    assert "layer 2: heavily_compressed_attention (ratio 4) vs compressed_sparse_attention" in message
    assert "sliding window 8 vs 128" in message
    check_served_models([FakeEngine(tiny_dir)], REFERENCE, tiny_dir, loop)  # the reference engine can


def test_an_engine_started_from_another_model_is_named(tiny_dir, servable_dir, loop):
    engines = [FakeEngine(tiny_dir), FakeEngine(servable_dir, base_url="http://engine-1")]
    message = refusal(engines, REFERENCE, tiny_dir, loop)
    assert "engine-0" not in message
    assert "engine http://engine-1: layer 2: heavily_compressed_attention (ratio 4) vs " in message
    assert "heavily_compressed_attention (ratio 128) (the recipe's model vs its config.json)" in message
    assert "sliding window 8 vs 128" in message


def test_overrides_sglang_applies_are_checked(servable_dir, loop):
    engine = FakeEngine(servable_dir, dtype="bfloat16", overrides=json.dumps({"num_hash_layers": 0}))
    message = refusal([engine], SGLANG, servable_dir, loop)
    assert "hash-routed layers [0] vs []" in message and "deepseek_v2.py:711" in message


def test_a_config_whose_keys_disagree_and_another_model_type_are_named(tmp_path, servable_dir, loop):
    edited = Path(materialize_model(SERVABLE, str(tmp_path / "edited")))
    config = json.loads((edited / "config.json").read_text())
    config["num_hash_layers"] = 2
    (edited / "config.json").write_text(json.dumps(config))
    message = refusal([FakeEngine(str(edited), model_type="llama")], REFERENCE, servable_dir, loop)
    assert "it serves model_type 'llama'" in message
    assert "its config.json: num_hash_layers=2 routes layers [0, 1] by hash" in message


@pytest.mark.parametrize(
    ("kind", "launch", "config", "dtype"),
    [
        (SGLANG, "auto", {"dtype": None}, "float16"),  # transformers' dtype: null, no --dtype: the issue
        (SGLANG, "auto", {"dtype": None, "torch_dtype": "float32"}, "float16"),
        (SGLANG, "auto", {"torch_dtype": "bfloat16"}, "bfloat16"),  # the release
        (SGLANG, "float", {"torch_dtype": "bfloat16"}, "float32"),
        (SGLANG, "half", {"torch_dtype": "bfloat16"}, "float16"),
        (REFERENCE, "auto", {"torch_dtype": "bfloat16"}, "float32"),
        (REFERENCE, "bfloat16", {}, "bfloat16"),
    ],
)
def test_served_dtype(kind, launch, config, dtype):
    assert served_dtype(kind, launch, config) == dtype
