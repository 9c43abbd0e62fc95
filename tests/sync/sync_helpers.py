"""Helpers for the weight-sync tests: free ports, subprocesses, tiny models from seeds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from dsv4rl.config.model_schema import ModelConfig
from dsv4rl.model.tiny import build_tiny_model
from dsv4rl.model.tokenizer import build_char_tokenizer

HERE = Path(__file__).parent
ENGINE_SEED = 11  # the engine starts from this model ...
TRAINER_SEED = 22  # ... and the trainer holds this one
ENGINE_TIMEOUT_S = 30  # the engine's group timeout: a wrong implementation fails instead of hanging


def run_python(script: str, *args: str, timeout: float = 60, env: dict | None = None) -> subprocess.Popen:
    """Start `python tests/sync/<script> args...` (bounded by the caller's communicate(timeout))."""
    return subprocess.Popen(
        [sys.executable, str(HERE / script), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


def vocab_size() -> int:
    return len(build_char_tokenizer())


@torch.no_grad()
def trainer_model(seed: int) -> torch.nn.Module:
    """The tiny model from `seed`, with the tensors every seed initialises alike (zeros, ones) randomised,
    so a sync that skips any of them (e_score_correction_bias, sinks, norms, hc base/scale) is caught."""
    model = build_tiny_model(ModelConfig(init_seed=seed), vocab_size())
    generator = torch.Generator().manual_seed(seed)
    for tensor in model.state_dict(keep_vars=True).values():
        if tensor.dtype.is_floating_point and tensor.numel() and bool((tensor == tensor.flatten()[0]).all()):
            tensor.add_(0.05 * torch.randn(tensor.shape, generator=generator))
    return model


def wire_tensors(model: torch.nn.Module, quant: str = "none") -> dict[str, torch.Tensor]:
    """What an engine of `quant` holds after a sync of `model`: its native tensors in the wire format."""
    from dsv4rl.model.naming import state_dict_to_native
    from dsv4rl.model.wire_format import WireFormat

    return WireFormat(quant).encode_all(state_dict_to_native(model.state_dict()))


def quantized_copy(model: torch.nn.Module, quant: str, directory: Path) -> torch.nn.Module:
    """`model` as an engine of `quant` computes with it: written in that format and dequantized again."""
    from dsv4rl.model.native_checkpoint import load_native_model, write_native_checkpoint
    from dsv4rl.model.wire_format import WireFormat

    write_native_checkpoint(model, directory, WireFormat(quant))
    return load_native_model(directory)
