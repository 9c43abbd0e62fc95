"""Every model directory dsv4rl writes or exports, read by SGLang 0.5.23's own config path in its own
interpreter: `get_config` (which re-reads a deepseek_v4 config.json as its DeepseekV3Config alias),
`get_rope_config`, the engine's `ModelConfig` (dtype under `--dtype auto`, quantization, the FP4-expert
detection from the safetensors headers, the attention window) and the loader's quantization config. What
SGLang reads must be what `dsv4rl.model.release_config`, `dsv4rl.sync.served_model` and
`dsv4rl.model.native_checkpoint.checkpoint_format` say it reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dsv4rl.config.choices import ExportFormat, QuantMode, RolloutEngineKind
from dsv4rl.config.compose import compose
from dsv4rl.config.schema import QuantConfig
from dsv4rl.export.run import export_checkpoint
from dsv4rl.model.model_dir import materialize_model
from dsv4rl.model.native_checkpoint import checkpoint_format
from dsv4rl.model.release_config import release_rope_scaling, sglang_schedule
from dsv4rl.quant.sglang_env import MXFP4
from dsv4rl.sync.served_model import served_dtype
from sglang_runner import needs_sglang

pytestmark = [*needs_sglang, pytest.mark.slow]

QUANTS = ("none", "bf16", "fp8_rollout", "fp8_mxfp4")


def _written(tmp: Path) -> list[str]:
    """The model directories `dsv4rl train` writes: each tiny model, the SGLang-shaped one in every mode."""
    dirs = []
    for model in ("tiny_dsv4", "tiny_dsv4_align"):
        cfg = compose("tiny_arith", [f"model={model}"])
        dirs.append(materialize_model(cfg.model, str(tmp / model), cfg.quant))
    servable = compose("tiny_arith", ["model=tiny_dsv4_sglang"]).model
    for quant in QUANTS:
        dirs.append(
            materialize_model(servable, str(tmp / f"sglang_{quant}"), QuantConfig(name=QuantMode(quant)))
        )
    return dirs


def _exported(tmp: Path) -> list[str]:
    """What `dsv4rl export` writes from a run's FSDP checkpoint: native in every quant mode, and hf."""
    from dsv4rl.launcher.run import write_config
    from dsv4rl.train.checkpoint import checkpoint_dir
    from dsv4rl.train.fsdp.backend import FSDPBackend

    run_dir = tmp / "run"
    run_dir.mkdir(parents=True)
    cfg = compose("tiny_arith", [f"run.dir={run_dir}"])
    write_config(cfg, run_dir)
    materialize_model(cfg.model, str(run_dir / "model"), cfg.quant)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp / "store"), 1), rank=0, world_size=1)
    try:
        backend = FSDPBackend(cfg, str(run_dir / "model"), torch.device("cpu"))
        backend.save_checkpoint(str(checkpoint_dir(run_dir / "checkpoints", 1)), {"data": None})
    finally:
        dist.destroy_process_group()
    outs = []
    for quant in QUANTS:
        outs.append(str(tmp / f"export_native_{quant}"))
        export_checkpoint(run_dir, outs[-1], fmt=ExportFormat.native, quant=QuantMode(quant))
    outs.append(str(tmp / "export_hf"))
    export_checkpoint(run_dir, outs[-1], fmt=ExportFormat.hf)
    return outs


def _check(directory: str, seen: dict) -> None:
    config = json.loads((Path(directory) / "config.json").read_text())
    schedule = sglang_schedule(config)
    assert seen["model_type"] == "deepseek_v4" and seen["architectures"] == ["DeepseekV4ForCausalLM"]
    assert seen["compress_ratios"][: config["num_hidden_layers"]] == list(schedule.compress_ratios)
    assert seen["engine_compress_ratios"][: config["num_hidden_layers"]] == list(schedule.compress_ratios)
    assert seen["num_hash_layers"] == sum(schedule.hash_routed) == 1
    assert seen["topk_method"] == "noaux_tc"
    assert seen["rope"] == {k: v for k, v in release_rope_scaling(config).items() if k != "type"}
    for key in ("rope_theta", "compress_rope_theta", "head_dim", "qk_rope_head_dim", "num_hidden_layers",
                "n_routed_experts", "num_experts_per_tok", "sliding_window", "index_topk", "hc_mult",
                "vocab_size"):  # fmt: skip
        assert seen[key] == config[key], key
    assert seen["window_size"] == config["sliding_window"]
    assert seen["dtype"] == served_dtype(RolloutEngineKind.sglang, "auto", config)
    if (
        "quantization_config" not in config
    ):  # unquantized (and hf exports): no quantization, BF16/FP32 experts
        assert seen["quantization"] is None and seen["quant_config"] is None
        return
    stored = checkpoint_format(directory)
    assert seen["quantization"] == "fp8"
    assert seen["quant_config"]["class"] == "Fp8Config"
    assert seen["quant_config"]["weight_block_size"] == list(stored.block)
    assert seen["is_fp4_experts"] == (stored.experts == MXFP4)  # SGLang's header detection agrees


def test_sglang_reads_every_directory_dsv4rl_writes(tmp_path: Path, sglang_sides) -> None:
    directories = _written(tmp_path)
    read = sglang_sides.get().call("config_read:read", paths=directories)
    for directory in directories:
        _check(directory, read[directory])
    dtypes = {Path(d).name: read[d]["dtype"] for d in directories}
    assert dtypes["tiny_dsv4"] == "float16"  # float32 -> float16 under auto: why dsv4rl passes --dtype
    assert dtypes["sglang_bf16"] == dtypes["sglang_fp8_rollout"] == "bfloat16"


def test_sglang_reads_every_export(tmp_path: Path, sglang_sides) -> None:
    directories = _exported(tmp_path)
    read = sglang_sides.get().call("config_read:read", paths=directories)
    for directory in directories:
        _check(directory, read[directory])
