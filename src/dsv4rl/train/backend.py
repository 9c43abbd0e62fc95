"""The trainer backend: what trains the policy (`parallel.train.backend`), chosen here once.

The loop (`dsv4rl.train.loop`), `dsv4rl align` and the worker know only the `TrainerBackend` protocol;
`fsdp` (`dsv4rl.train.fsdp`) and `megatron` (`dsv4rl.train.megatron`) are sibling packages, both running
the one update loop of `dsv4rl.train.update`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from dsv4rl.config.choices import TrainBackend
from dsv4rl.config.schema import Config
from dsv4rl.train.batch import TrainBatch


class TrainerBackend(Protocol):
    """The seam to the training backend. All methods are collective.

    A rank trains on its data-parallel replica's share of each batch: `data_parallel_rank` of
    `data_parallel_size` (FSDP: every rank is a replica; Megatron: the TP/PP ranks of one replica
    share it). `hf_config` is the transformers config of the model being trained.
    `weight_source_ranks` are the global ranks that send the weights, one per pipeline stage; with
    `by_stage` each of them yields its own stage from `named_weights_for_sync`, else rank 0 yields all.
    `local_weights` / `local_gradients` are this rank's own tensors (shards), no communication: what the
    non-finite guard (`dsv4rl.train.nonfinite`) checks before a sync or a checkpoint."""

    device: torch.device
    data_parallel_rank: int
    data_parallel_size: int
    hf_config: Any
    weight_source_ranks: Sequence[int]

    def train_step(self, batch: TrainBatch, temperature: float | None = None) -> dict[str, float]: ...

    def compute_logprobs(self, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor: ...

    def named_weights_for_sync(self, by_stage: bool = False) -> Iterator[tuple[str, torch.Tensor]]: ...

    def local_weights(self) -> Iterator[tuple[str, torch.Tensor]]: ...

    def local_gradients(self) -> Iterator[tuple[str, torch.Tensor]]: ...

    def save_checkpoint(self, directory: str, extra_state: dict[str, Any]) -> Path: ...

    def load_checkpoint(self, directory: str) -> dict[str, Any]: ...


def build_backend(cfg: Config, model_path: str, device: torch.device | None) -> TrainerBackend:
    """The backend of `parallel.train.backend`, loaded from `model_path` on this rank's `device`."""
    if TrainBackend(cfg.parallel.train.backend) == TrainBackend.fsdp:
        from dsv4rl.train.fsdp.backend import FSDPBackend

        return FSDPBackend(cfg, model_path, device)
    from dsv4rl.train.megatron.backend import MegatronBackend

    return MegatronBackend(cfg, model_path, device)
