"""Quantization rules: the `quant` group against the engines that will hold the weights.

`check_quant` reads only the recipe: block size, SGLang's environment for the chosen mode
(`dsv4rl.quant.sglang_env`), SGLang's `--dtype` against what the trainer sends, and verification settings
that depend on the engine. Whether SGLang's MoE path on `cluster.device` can take updates at all is a row
of `dsv4rl.checks.sglang_families`.
`check_checkpoint_format` (a path rule: it reads the checkpoint's safetensors headers) refuses a
`model.path` whose stored format the chosen mode cannot update.
"""

from __future__ import annotations

from pathlib import Path

from dsv4rl.checks.problems import Add
from dsv4rl.config.choices import QuantMode, RolloutEngineKind
from dsv4rl.config.schema import Config
from dsv4rl.quant import sglang_env
from dsv4rl.quant.sglang_env import engine_env

QUANTIZED = (QuantMode.fp8_rollout, QuantMode.fp8_mxfp4)


def check_quant(cfg: Config, add: Add) -> None:
    q, engine = cfg.quant, cfg.parallel.rollout.engine
    if len(q.block_size) != 2 or any(b < 1 for b in q.block_size):
        add(f"quant.block_size must be two positive sizes (got {list(q.block_size)})")
    elif engine == RolloutEngineKind.sglang and q.name in QUANTIZED and list(q.block_size) != [128, 128]:
        add(
            f"quant.block_size={list(q.block_size)}: SGLang's DeepSeek-V4 FP8 layers take 128x128 blocks; "
            "set quant.block_size=[128,128]"
        )
    if engine == RolloutEngineKind.sglang:  # the reference engine holds its checkpoint as stored
        for problem in sglang_env.env_problems(q.name, engine_env(cfg)):
            add(problem)
        check_engine_dtype(cfg, add)
    v = cfg.sync.verify
    if v.checksum and engine == RolloutEngineKind.sglang:
        add(
            "sync.verify.checksum=true needs engines that hash what they hold under the checkpoint's names "
            "(the reference engine); SGLang's checksums cover its internal, dequantized tensors and never "
            "equal the trainer's: set sync.verify.checksum=false and use sync.verify.logprob_probe=true"
        )
    if v.every_steps < 1:
        add(f"sync.verify.every_steps must be >= 1 (got {v.every_steps})")
    if v.logprob_probe and (v.probe_sequences < 1 or v.probe_length < 2):
        add(
            "sync.verify.probe_sequences must be >= 1 and probe_length >= 2 "
            f"(got {v.probe_sequences}, {v.probe_length})"
        )
    if v.max_mean_abs_diff is not None and v.max_mean_abs_diff <= 0:
        add(
            "sync.verify.max_mean_abs_diff must be > 0, or null for the quant mode's bound "
            f"(got {v.max_mean_abs_diff})"
        )


def check_engine_dtype(cfg: Config, add: Add) -> None:
    """quant=none sends the trainer's own dtype (`model.dtype`): SGLang engines must hold that dtype, or
    they refuse the update ("Downcasting not allowed") or cast it."""
    if cfg.quant.name == QuantMode.none and cfg.engine.dtype != cfg.model.dtype:
        add(
            f"quant=none sends {cfg.model.dtype.value} weights (model.dtype), but SGLang engines run "
            f"--dtype {cfg.engine.dtype.value} (engine.dtype): set engine.dtype={cfg.model.dtype.value}, "
            f"or send quant=bf16"
        )


def check_checkpoint_format(cfg: Config, add: Add) -> None:
    """model.path's stored format against `quant` (the tiny model is written in the recipe's format)."""
    if cfg.model.path is None or not Path(cfg.model.path).expanduser().is_dir():
        return  # check_paths reports a missing directory
    from dsv4rl.model.native_checkpoint import CheckpointError, checkpoint_format, tensor_dtypes

    path = str(Path(cfg.model.path).expanduser())
    try:
        native = "embed.weight" in tensor_dtypes(path)
    except CheckpointError as error:
        add(str(error))
        return
    if not native:
        if cfg.quant.name in QUANTIZED:
            add(
                f"model.path {cfg.model.path!r} is a transformers checkpoint (no native DeepSeek-V4 tensor "
                f"names), but quant={cfg.quant.name.value} needs engines serving an FP8 native checkpoint"
            )
        return
    try:
        stored = checkpoint_format(path)
    except CheckpointError as error:
        add(str(error))
        return
    if cfg.parallel.rollout.engine == RolloutEngineKind.sglang:
        for problem in sglang_env.checkpoint_problems(cfg.quant.name, engine_env(cfg), stored.experts):
            add(problem)
    elif stored.mode != cfg.quant.name:
        fix = f"set quant={stored.mode.value}" if stored.mode is not None else "convert it"
        add(
            f"model.path {cfg.model.path!r} holds {stored.describe()}, but quant={cfg.quant.name.value}: the "
            f"reference engine holds the checkpoint as stored and refuses any other format; {fix}"
        )
