"""Resumable training checkpoints: model + optimizer (torch.distributed.checkpoint), the trainer's counters
(train steps, optimizer steps: the learning-rate schedule's position) and a per-rank extra state (data
cursor, RNG states).

Layout of `<root>/step_00000010/`:
  DCP shards + `.metadata`      model and optimizer, resharded on load (any world size)
  trainer_state.pt              the counters and the world size (written by rank 0)
  extra_rank00000.pt, ...       the caller's extra_state and the RNG states of each rank

Every rank writes into `<dir>.tmp`; rank 0 renames it to `<dir>` once all ranks are done, so a
directory with the final name is always complete. The tmp directory must be on a filesystem that
every rank sees (on several nodes: a shared filesystem).
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from dsv4rl.train.checkpoint_dirs import (  # noqa: F401  (callers import them from here too)
    TRAINER_STATE,
    checkpoint_dir,
    latest_checkpoint,
    prune_checkpoints,
)


def capture_rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


@contextmanager
def _checkpoint_group() -> Iterator[dist.ProcessGroup | None]:
    """The process group DCP's collectives run on: on gloo, one made for this save or load and destroyed
    after it; otherwise the default group.

    Gloo runs a collective's tensor copies on its own worker threads. With more than one intra-op thread,
    each of those workers starts an OpenMP team of its own and keeps it while the thread lives. Once
    libgomp manages more threads than there are cores, it stops spinning at its barriers (GOMP_SPINCOUNT's
    throttled count), so every parallel op of every later training step sleeps and wakes its threads
    (train steps a third slower or worse after one save). Destroying the group joins its worker threads,
    and that ends their teams.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() != "gloo":
        yield None
        return
    group = dist.new_group(backend="gloo")
    try:
        yield group
    finally:
        dist.destroy_process_group(group)


def save_checkpoint(
    directory: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    counters: dict[str, int],
    extra_state: dict[str, Any] | None = None,
    keep: int = 0,
) -> Path:
    """Collective: every rank calls it. Returns the final directory. `counters` (`step`, `updates`) come
    back from `load_checkpoint`; `keep` > 0 prunes older siblings."""
    rank, world = _rank_world()
    final = Path(directory)
    tmp = prepare_staging(final)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with _checkpoint_group() as group:
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp), process_group=group)
    save_rank_state(tmp, extra_state)
    trainer_state = {**counters, "world_size": world}
    return publish(tmp, final, trainer_state, keep)


def prepare_staging(final: Path) -> Path:
    """Collective: the empty `<final>.tmp` every rank writes into."""
    tmp = final.with_name(final.name + ".tmp")
    if _rank_world()[0] == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    return tmp


def save_rank_state(tmp: Path, extra_state: dict[str, Any] | None) -> None:
    """This rank's extra state and RNG states."""
    rank = _rank_world()[0]
    torch.save({"extra": extra_state or {}, "rng": capture_rng_state()}, tmp / f"extra_rank{rank:05d}.pt")


def publish(tmp: Path, final: Path, trainer_state: dict[str, Any], keep: int) -> Path:
    """Collective, after every rank wrote into `tmp`: rank 0 writes `trainer_state` (the last file: its
    presence marks completeness), renames `tmp` to `final` and prunes to the newest `keep`."""
    _barrier()
    if _rank_world()[0] == 0:
        torch.save(trainer_state, tmp / TRAINER_STATE)
        old = final.with_name(final.name + ".old")
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
        if keep > 0:
            prune_checkpoints(final.parent, keep)
    _barrier()
    return final


def load_checkpoint(
    directory: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, int], dict[str, Any]]:
    """Collective. Loads model, optimizer and this rank's RNG states; returns (counters, extra_state).

    The model and optimizer reshard to any world size. Extra state and RNG states are per rank: with
    a different world size, ranks without their own file get rank 0's extra state and keep their RNG.
    """
    rank, _ = _rank_world()
    path = Path(directory)
    if not (path / TRAINER_STATE).exists():
        raise FileNotFoundError(
            f"{path} is not a complete checkpoint (no {TRAINER_STATE}); "
            "use latest_checkpoint(root) to find one"
        )
    model_sd, optim_sd = get_state_dict(model, optimizer)
    saved_keys = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    missing = [k for k in model_sd if f"model.{k}" not in saved_keys]
    if missing:
        raise ValueError(
            f"checkpoint {path} lacks model tensors {missing[:5]} (of {len(missing)}): wrong model?"
        )
    state = {"model": model_sd, "optim": optim_sd}
    # Partial load: parameters that never received a gradient (the HF indexer) have no optimizer
    # state in the checkpoint; the model itself was checked complete above.
    with _checkpoint_group() as group:
        planner = DefaultLoadPlanner(allow_partial_load=True)
        dcp.load(state, checkpoint_id=str(path), planner=planner, process_group=group)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    trainer_state = torch.load(path / TRAINER_STATE, weights_only=False)
    counters = {key: value for key, value in trainer_state.items() if isinstance(value, int)}
    counters.pop("world_size", None)
    if "scheduler" in trainer_state:  # written before the counters: its position is the optimizer steps
        counters.setdefault("updates", int(trainer_state["scheduler"]["last_epoch"]))
    own = path / f"extra_rank{rank:05d}.pt"
    per_rank = torch.load(own if own.exists() else path / "extra_rank00000.pt", weights_only=False)
    if own.exists():
        restore_rng_state(per_rank["rng"])
    _barrier()
    return counters, per_rank["extra"]
