"""Resumable training checkpoints: model + optimizer (torch.distributed.checkpoint), the trainer's counters
(train steps, optimizer steps: the learning-rate schedule's position) and a per-rank extra state (data
cursor, RNG states).

Layout of `<root>/step_00000010/`:
  DCP shards + `.metadata`      model and optimizer, resharded on load (any world size)
  trainer_state.pt              the counters and the world size (written by rank 0)
  extra_rank00000.pt, ...       the caller's extra_state and the RNG states of each rank

Every rank writes into `<dir>.tmp`; rank 0 fsyncs its files and directories, renames it to `<dir>` once
all ranks are done and fsyncs the parent, so a directory with the final name is complete, also after a
machine crash. The tmp directory must be on a filesystem that every rank sees (on several nodes: a shared
filesystem).

A checkpoint that looks complete can still fail to load (a file truncated or corrupted on disk since):
`load_newest` then says which and why, and falls back to the next older complete one.
"""

from __future__ import annotations

import logging
import random
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from dsv4rl.faults.files import fsync_dir, fsync_file, fsync_tree
from dsv4rl.faults.notices import notify
from dsv4rl.train.checkpoint_dirs import (  # noqa: F401  (callers import them from here too)
    TRAINER_STATE,
    checkpoint_dir,
    complete_checkpoints,
    latest_checkpoint,
    prune_checkpoints,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_REASON_CHARS = 240
# What a failed load raises: DCP's CheckpointException (which megatron's loader also lets through) is a
# BaseException, not an Exception.
LOAD_ERRORS = (Exception, CheckpointException)


class CheckpointUnreadable(RuntimeError):
    """A checkpoint with every file in place (`trainer_state.pt` written last) that does not load: a file
    truncated or corrupted since it was written. Raised on every rank together."""

    def __init__(self, path: Path, reason: str, message: str | None = None) -> None:
        super().__init__(message or f"checkpoint {path} cannot be loaded: {reason}")
        self.path, self.reason = Path(path), reason


def _reason(error: BaseException) -> str:
    """One line: the exception's type and the first line of its message, cut to a readable length. DCP's
    CheckpointException stands for the first rank's own exception (its message only lists the ranks)."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, (inner, _) = min(error.failures.items(), key=lambda item: item[0])
        return _reason(inner) if len(error.failures) == 1 else f"rank {rank}: {_reason(inner)}"
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."


def _gather_reasons(reason: str | None) -> list[str | None]:
    """Collective: every rank's `reason` (None: it did fine)."""
    rank, world = _rank_world()
    if world == 1:
        return [reason]
    reasons: list[str | None] = [None] * world
    dist.all_gather_object(reasons, reason)
    return reasons


def _agree(path: Path, reason: str | None) -> None:
    """Collective: raise `CheckpointUnreadable` on every rank when any rank gives a reason."""
    reasons = _gather_reasons(reason)
    failed = [(rank, text) for rank, text in enumerate(reasons) if text is not None]
    if failed:
        rank, text = failed[0]
        raise CheckpointUnreadable(path, text if len(reasons) == 1 else f"rank {rank}: {text}")


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
    """This rank's extra state and RNG states, on disk when it returns (rank 0 fsyncs the rest)."""
    rank = _rank_world()[0]
    path = tmp / f"extra_rank{rank:05d}.pt"
    torch.save({"extra": extra_state or {}, "rng": capture_rng_state()}, path)
    fsync_file(path)  # on a shared filesystem, the writer's own fsync is what reaches the server


def publish(tmp: Path, final: Path, trainer_state: dict[str, Any], keep: int) -> Path:
    """Collective, after every rank wrote into `tmp`: rank 0 writes `trainer_state` (the last file: its
    presence marks completeness), fsyncs every file and directory of `tmp`, renames it to `final`, fsyncs
    the parent (the rename) and prunes to the newest `keep`. Without the fsyncs a machine crash can leave
    a `final` whose files are empty or short: the rename reaches the disk before the data on ext4 and XFS."""
    _barrier()
    if _rank_world()[0] == 0:
        torch.save(trainer_state, tmp / TRAINER_STATE)
        fsync_tree(tmp)
        old = final.with_name(final.name + ".old")
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        tmp.rename(final)
        fsync_dir(final.parent)
        fsync_dir(final.parent.parent)  # the checkpoints/ directory itself, made by the first save
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
    A file that cannot be read raises `CheckpointUnreadable` on every rank: the small files are read
    (and agreed on) before the model is touched; DCP reports a failed shard read on every rank itself.
    """
    rank, _ = _rank_world()
    path = Path(directory)
    if not (path / TRAINER_STATE).exists():
        raise FileNotFoundError(
            f"{path} is not a complete checkpoint (no {TRAINER_STATE}); "
            "use latest_checkpoint(root) to find one"
        )
    own = path / f"extra_rank{rank:05d}.pt"
    reason, reading = None, TRAINER_STATE
    try:
        trainer_state = torch.load(path / TRAINER_STATE, weights_only=False)
        reading = (own if own.exists() else path / "extra_rank00000.pt").name
        per_rank = torch.load(path / reading, weights_only=False)
        reading = ".metadata"
        saved_keys = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    except LOAD_ERRORS as error:  # a truncated or corrupted file: any of pickle's, zip's or torch's errors
        reason = f"{reading}: {_reason(error)}"
    _agree(path, reason)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    missing = [k for k in model_sd if f"model.{k}" not in saved_keys]
    if missing:
        raise ValueError(
            f"checkpoint {path} lacks model tensors {missing[:5]} (of {len(missing)}): wrong model?"
        )
    state = {"model": model_sd, "optim": optim_sd}
    # Partial load: parameters that never received a gradient (the HF indexer) have no optimizer
    # state in the checkpoint; the model itself was checked complete above.
    try:
        with _checkpoint_group() as group:
            planner = DefaultLoadPlanner(allow_partial_load=True)
            dcp.load(state, checkpoint_id=str(path), planner=planner, process_group=group)
    except LOAD_ERRORS as error:  # DCP gathers every rank's read errors and raises them on all ranks
        raise CheckpointUnreadable(path, f"model/optimizer shards (*.distcp): {_reason(error)}") from error
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    # the counters are the ints (the finite mark, a bool, is not one of them)
    counters = {key: value for key, value in trainer_state.items() if type(value) is int}
    counters.pop("world_size", None)
    if "scheduler" in trainer_state:  # written before the counters: its position is the optimizer steps
        counters.setdefault("updates", int(trainer_state["scheduler"]["last_epoch"]))
    if own.exists():
        restore_rng_state(per_rank["rng"])
    _barrier()
    return counters, per_rank["extra"]


def load_newest(root: str | Path, load: Callable[[str], T]) -> tuple[Path, T] | None:
    """Collective: `load(directory)` of the newest complete checkpoint under `root` that loads; None when
    there is none. One that fails to load (on any rank) is named, on the console and in the log, with
    why, and the next older one is tried; when none loads, `CheckpointUnreadable` lists every one.

    An older checkpoint loads over whatever a failed attempt left in the model and optimizer: every
    checkpoint of a run holds the same tensors."""
    candidates = complete_checkpoints(root)
    failures: list[str] = []
    for index, path in enumerate(candidates):
        reason = None
        try:
            result = load(str(path))
        except LOAD_ERRORS as error:
            reason = error.reason if isinstance(error, CheckpointUnreadable) else _reason(error)
        failed = [text for text in _gather_reasons(reason) if text is not None]
        if not failed:
            if failures and _rank_world()[0] == 0:
                notify(f"resumed from the older checkpoint {path} instead", log)
            return path, result
        failures.append(f"{path.name}: {failed[0]}")
        if _rank_world()[0] == 0:
            older = candidates[index + 1] if index + 1 < len(candidates) else None
            then = f"falling back to {older.name}" if older is not None else "no older checkpoint is left"
            notify(f"checkpoint {path} cannot be loaded ({failed[0]}); {then}", log)
    if not candidates:
        return None
    reason = "; ".join(failures)
    raise CheckpointUnreadable(
        Path(root),
        reason,
        f"none of the {len(candidates)} checkpoint(s) in {root} loads ({reason}); to start over from "
        "step 0, move them away (or use a new run.dir)",
    )
