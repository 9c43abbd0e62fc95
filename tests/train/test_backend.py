"""The backend factory: the worker gets its trainer backend from `parallel.train.backend`."""

from __future__ import annotations

import pytest
import torch

from dsv4rl.config.choices import TrainBackend
from dsv4rl.config.schema import Config
from dsv4rl.train.backend import build_backend


def test_megatron_is_built_by_the_factory() -> None:
    """Outside torchrun the megatron backend refuses to start: the factory did pick it."""
    cfg = Config()
    cfg.parallel.train.backend = TrainBackend.megatron
    with pytest.raises(RuntimeError, match="megatron trainer backend needs an initialised default process"):
        build_backend(cfg, "/nonexistent", torch.device("cpu"))


def test_fsdp_is_built_by_the_factory() -> None:
    """Outside torchrun the fsdp backend refuses to start: the factory did pick it."""
    with pytest.raises(RuntimeError, match="the fsdp trainer backend needs an initialised default process"):
        build_backend(Config(), "/nonexistent", torch.device("cpu"))
