"""The backend factory: the worker gets its engine from `parallel.train.backend`, nothing hard-wired."""

from __future__ import annotations

import pytest
import torch

from dsv4rl.config.schema import Config, TrainBackend
from dsv4rl.train.engines import build_train_engine


def test_megatron_is_built_by_the_factory() -> None:
    """Outside torchrun the Megatron engine refuses to start: the factory did pick it."""
    cfg = Config()
    cfg.parallel.train.backend = TrainBackend.megatron
    with pytest.raises(RuntimeError, match="MegatronTrainEngine needs an initialised default process group"):
        build_train_engine(cfg, "/nonexistent", torch.device("cpu"))


def test_fsdp_is_built_by_the_factory() -> None:
    """Outside torchrun the FSDP engine refuses to start: the factory did pick it."""
    with pytest.raises(RuntimeError, match="FSDPTrainEngine needs an initialised default process group"):
        build_train_engine(Config(), "/nonexistent", torch.device("cpu"))
