"""Which train engine a recipe gets: `parallel.train.backend`, decided here once (the worker and the
loop only know the `TrainEngine` protocol of `dsv4rl.train.loop`)."""

from __future__ import annotations

import torch

from dsv4rl.config.schema import Config, TrainBackend
from dsv4rl.train.loop import TrainEngine


def build_train_engine(cfg: Config, model_path: str, device: torch.device) -> TrainEngine:
    """The engine of `parallel.train.backend`, loaded from `model_path` on this rank's `device`."""
    backend = TrainBackend(cfg.parallel.train.backend)
    if backend == TrainBackend.fsdp:
        from dsv4rl.train.fsdp_engine import FSDPTrainEngine

        return FSDPTrainEngine(cfg, model_path, device)
    from dsv4rl.train.megatron.engine import MegatronTrainEngine

    return MegatronTrainEngine(cfg, model_path, device)
