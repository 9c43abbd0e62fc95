"""A directory dsv4rl writes, read through SGLang 0.5.23's own config path (`get_config`, which re-reads a
deepseek_v4 config.json as its DeepseekV3Config alias; `get_rope_config`; `_get_and_verify_dtype`) in the
SGLang environment's interpreter: it sees the compress ratios, hash-routed layers, RoPE and dtype that
`dsv4rl.model.release_config` and `dsv4rl.sync.served_model` say it does. Skipped where that environment
is not installed (`make install-sglang`, or `$DSV4RL_SGLANG_PYTHON`); ~30 s (importing sglang)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from dsv4rl.config.schema import ModelConfig, QuantConfig, QuantMode, RolloutEngineKind, TinyModelConfig
from dsv4rl.model.model_dir import materialize_model
from dsv4rl.model.release_config import release_rope_scaling, sglang_schedule
from dsv4rl.sync.served_model import served_dtype

SGLANG_PYTHON = Path(
    os.environ.get("DSV4RL_SGLANG_PYTHON") or Path(__file__).resolve().parents[2] / ".venv-sglang/bin/python"
)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason="no .venv-sglang (make install-sglang)"),
]

READ = """
import json, sys
from sglang.srt.configs.model_config import _get_and_verify_dtype
from sglang.srt.utils.hf_transformers.common import get_rope_config
from sglang.srt.utils.hf_transformers.config import get_config
out = {}
for path in sys.argv[1:]:
    config = get_config(path, trust_remote_code=False)
    theta, rope = get_rope_config(config)
    out[path] = {
        "model_type": config.model_type,
        "compress_ratios": list(config.compress_ratios),
        "num_hash_layers": getattr(config, "num_hash_layers", 0),
        "topk_method": getattr(config, "topk_method", None),
        "rope_theta": theta,
        "rope": {k: rope.get(k) for k in ("factor", "original_max_position_embeddings", "beta_fast",
                                          "beta_slow")},
        "compress_rope_theta": config.compress_rope_theta,
        "head_dim": config.head_dim,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "dtype": str(_get_and_verify_dtype(config, "auto")).removeprefix("torch."),
    }
print(json.dumps(out))
"""


def test_sglang_reads_the_release_keys_dsv4rl_writes(tmp_path: Path) -> None:
    servable = ModelConfig(tiny=TinyModelConfig(hca_compress_rate=128, sliding_window=128))
    directories = [
        materialize_model(ModelConfig(), str(tmp_path / "tiny")),  # float32, HCA at ratio 4
        materialize_model(servable, str(tmp_path / "servable"), QuantConfig(name=QuantMode.bf16)),
    ]
    script = tmp_path / "read.py"
    script.write_text(READ)
    result = subprocess.run(
        [str(SGLANG_PYTHON), str(script), *directories], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    read = json.loads(result.stdout.strip().splitlines()[-1])
    for directory in directories:
        config = json.loads((Path(directory) / "config.json").read_text())
        seen, schedule = read[directory], sglang_schedule(config)
        assert seen["model_type"] == "deepseek_v4"
        assert seen["compress_ratios"][: config["num_hidden_layers"]] == list(schedule.compress_ratios)
        assert seen["num_hash_layers"] == sum(schedule.hash_routed) == 1
        assert seen["topk_method"] == "noaux_tc"
        expected_rope = {k: v for k, v in release_rope_scaling(config).items() if k != "type"}
        assert seen["rope"] == expected_rope
        for key in ("rope_theta", "compress_rope_theta", "head_dim", "qk_rope_head_dim"):
            assert seen[key] == config[key], key
        assert seen["dtype"] == served_dtype(RolloutEngineKind.sglang, "auto", config)
    assert [read[d]["dtype"] for d in directories] == ["float16", "bfloat16"]  # float32 -> float16 under auto
