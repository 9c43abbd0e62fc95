"""Checkpoints of the megatron trainer backend with megatron-core's distributed checkpointing.

The model's `sharded_state_dict` names every tensor globally (layers by their global number, experts
by their global index, TP splits by their axis), so a checkpoint written at one parallel layout loads
at another. The optimizer state follows its parameters' sharding: megatron's distributed optimizer
describes itself (GPU); the CPU AdamW's moments are mapped onto the same sharded parameters.

Layout of `<root>/step_00000010/`: megatron's shard files, `trainer_state.pt` (step, optimizer steps
taken; written last, so its presence marks a complete checkpoint) and `extra_rank00000.pt`, ... (the
loop's extra state and each rank's RNG states). Written into `<dir>.tmp`, fsynced (every rank its own
extra file; rank 0 the whole directory) and renamed when complete (`dsv4rl.train.checkpoint.publish`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    optim_state_to_sharding_state,
)

from dsv4rl.train.checkpoint import (
    TRAINER_STATE,
    prepare_staging,
    publish,
    restore_rng_state,
    save_rank_state,
)
from dsv4rl.train.megatron.model import DeepseekV4Model
from dsv4rl.train.megatron.optimizer import ModelParallelAdamW, StepOptimizer

FREEZE, FROZEN = "freeze", "frozen"  # trainer_state.pt: the run's train.freeze, the tensors it froze


def _optimizer_sharded_state(optimizer: StepOptimizer, model_state: dict, is_loading: bool) -> dict:
    """The optimizer's part of the checkpoint. megatron's distributed optimizer gives its state tensors
    to load into only with `is_loading` (it then allocates the state of an optimizer that has not
    stepped, `megatron/core/optimizer/distrib_optimizer.py:1264`); without, a fresh optimizer describes
    no Adam moments (they would not load) or, precision-aware with offload, fails on 'master_param'."""
    if not isinstance(optimizer, ModelParallelAdamW):
        return optimizer.optimizer.sharded_state_dict(model_state, is_loading=is_loading)
    optimizer.initialise_state()
    state = optimizer.state_dict()
    id_to_sharded = get_param_id_to_sharded_param_map(model_state, iter(optimizer.parameters))
    optim_state_to_sharding_state(state, id_to_sharded, exclude_keys=("step",))
    return state


def _sharded_state(model: DeepseekV4Model, optimizer: StepOptimizer, is_loading: bool) -> dict:
    model_state = model.sharded_state_dict()
    return {"model": model_state, "optimizer": _optimizer_sharded_state(optimizer, model_state, is_loading)}


@dataclass(frozen=True)
class Frozen:
    """`train.freeze` of a run and the tensors it froze (transformers' names), kept in `trainer_state.pt`."""

    entries: list[str] = field(default_factory=list)
    tensors: list[str] = field(default_factory=list)


def save_checkpoint(
    model: DeepseekV4Model,
    optimizer: StepOptimizer,
    counters: dict[str, int],
    directory: str,
    extra_state: dict[str, Any],
    keep: int = 0,
    frozen: Frozen | None = None,
) -> Path:
    """Collective. `counters`: the train steps and optimizer steps taken (`step`, `updates`). Returns the
    final directory; `keep` > 0 prunes older siblings."""
    final = Path(directory)
    tmp = prepare_staging(final)
    dist_checkpointing.save(_sharded_state(model, optimizer, is_loading=False), str(tmp))
    save_rank_state(tmp, extra_state)
    frozen = frozen or Frozen()
    trainer_state = {
        **counters,
        "world_size": dist.get_world_size(),
        FREEZE: frozen.entries,
        FROZEN: frozen.tensors,
    }
    return publish(tmp, final, trainer_state, keep)


def refuse_unfrozen(path: Path, trainer_state: dict[str, Any], frozen: Frozen) -> None:
    """A checkpoint whose run froze tensors that this run trains cannot resume here: the optimizer holds no
    state for them, and megatron's checkpoints load an optimizer's state only whole."""
    unfrozen = sorted(set(trainer_state.get(FROZEN, [])) - set(frozen.tensors))
    if unfrozen:
        raise ValueError(
            f"checkpoint {path} was written with train.freeze={trainer_state.get(FREEZE)}, and "
            f"train.freeze={frozen.entries} trains {len(unfrozen)} of the tensors it kept fixed "
            f"({', '.join(unfrozen[:3])}{', ...' if len(unfrozen) > 3 else ''}): the megatron backend "
            "resumes an optimizer only with the state of every parameter it trains. Resume with those "
            "tensors frozen, or start a new run from the checkpoint's weights (`dsv4rl export`)"
        )


def load_checkpoint(
    model: DeepseekV4Model, optimizer: StepOptimizer, directory: str, frozen: Frozen | None = None
) -> tuple[dict[str, int], dict[str, Any]]:
    """Collective: model, optimizer and this rank's RNG states; returns (counters, extra_state)."""
    path = Path(directory)
    if not (path / TRAINER_STATE).exists():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {TRAINER_STATE})")
    trainer_state = torch.load(path / TRAINER_STATE, weights_only=False)
    refuse_unfrozen(path, trainer_state, frozen or Frozen())
    counters = {"step": int(trainer_state["step"]), "updates": int(trainer_state["updates"])}
    loaded = dist_checkpointing.load(_sharded_state(model, optimizer, is_loading=True), str(path))
    model.load_state_dict(loaded["model"])
    if isinstance(optimizer, ModelParallelAdamW):
        # Adam's per-parameter step is not sharded state: every parameter steps with every update
        for state in loaded["optimizer"]["state"].values():
            state["step"] = torch.tensor(float(counters["updates"]))
    optimizer.load_state_dict(loaded["optimizer"])
    own = path / f"extra_rank{dist.get_rank():05d}.pt"
    per_rank = torch.load(own if own.exists() else path / "extra_rank00000.pt", weights_only=False)
    if own.exists():
        restore_rng_state(per_rank["rng"])
    dist.barrier()
    return counters, per_rank["extra"]
