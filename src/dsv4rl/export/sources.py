"""The full, transformers-named tensors of a training checkpoint, read one at a time from its shards.

Both backends' checkpoints are torch distributed checkpoints (DCP) whose metadata names every tensor by
its global shape: FSDP's under `model.<transformers name>`, Megatron's (megatron-core's `torch_dist`
format, `metadata.json` says so) under Megatron's global names, tensor-parallel splits and experts
already placed in one global tensor. So a tensor is read whole, from whichever files hold its pieces,
without a process group and at any layout the checkpoint was written at; only the tensor being read
(plus what the writer buffers) is in memory.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dsv4rl.train.checkpoint_dirs import TRAINER_STATE, checkpoint_dir, latest_checkpoint

MEGATRON_METADATA = "metadata.json"  # megatron-core's dist_checkpointing marks its checkpoints with it
_STEP = re.compile(r"^step_(\d+)$")


class ExportError(ValueError):
    """A run directory or checkpoint that cannot be exported; the message names the problem and the fix."""


class CheckpointBackend(StrEnum):
    fsdp = "fsdp"
    megatron = "megatron"


@dataclass(frozen=True)
class Checkpoint:
    run_dir: Path
    path: Path
    step: int
    backend: CheckpointBackend


def find_checkpoint(target: str | Path, step: int | None = None) -> Checkpoint:
    """`target`: a run dir (its newest complete checkpoint, or `step`'s) or a `checkpoints/step_N` dir."""
    target = Path(target)
    match = _STEP.match(target.name)
    if match is not None and target.parent.name == "checkpoints":
        if step is not None and step != int(match.group(1)):
            raise ExportError(f"{target} is the checkpoint of step {int(match.group(1))}, not --step {step}")
        run_dir, path = target.parent.parent, target
    else:
        run_dir = target
        if not (run_dir / "config.yaml").is_file():
            raise ExportError(
                f"{run_dir} is not a run directory (no config.yaml): pass the run.dir of a `dsv4rl train` "
                "run, or one of its checkpoints/step_N directories"
            )
        root = run_dir / "checkpoints"
        path = checkpoint_dir(root, step) if step is not None else latest_checkpoint(root)
        if path is None:
            raise ExportError(
                f"{run_dir} has no complete checkpoint in checkpoints/ (train.checkpoint_every writes them)"
            )
    if not (path / TRAINER_STATE).is_file():
        found = sorted(p.name for p in path.parent.glob("step_*")) if path.parent.is_dir() else []
        raise ExportError(
            f"{path} is not a complete checkpoint (no {TRAINER_STATE}); complete ones: {found or 'none'}"
        )
    if not (run_dir / "config.yaml").is_file():
        raise ExportError(f"{run_dir} has no config.yaml: the checkpoint's run directory is needed")
    backend = CheckpointBackend.megatron if (path / MEGATRON_METADATA).is_file() else CheckpointBackend.fsdp
    return Checkpoint(run_dir, path, int(_STEP.match(path.name).group(1)), backend)


def _read_one(path: Path, key: str, meta: TensorStorageMetadata) -> torch.Tensor:
    """One whole tensor of a DCP checkpoint, assembled from its chunks by DCP's own reader."""
    tensor = torch.empty(meta.size, dtype=meta.properties.dtype)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(
            {key: tensor},
            storage_reader=dcp.FileSystemReader(str(path)),
            planner=DefaultLoadPlanner(allow_partial_load=True),
            no_dist=True,
        )
    return tensor


def _tensor_keys(path: Path) -> dict[str, TensorStorageMetadata]:
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    return {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def fsdp_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(transformers name, tensor) of the model in an FSDP checkpoint (`model.` prefix; not the optimizer)."""
    keys = {k: v for k, v in _tensor_keys(path).items() if k.startswith("model.")}
    if not keys:
        raise ExportError(f"{path} holds no model tensors (no `model.*` keys in its .metadata)")
    for key, meta in keys.items():
        yield key.removeprefix("model."), _read_one(path, key, meta)


_MEGATRON_MODEL = re.compile(r"^(decoder|embedding|output_layer)\.")
_STACKED_EXPERT = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.experts\.linear_fc([12])\.weight$")


def megatron_tensors(path: Path, vocab_size: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(transformers name, tensor) of the model in a Megatron checkpoint, by the backend's own name rules
    (`dsv4rl.train.megatron.convert`) at tensor/expert-parallel size 1: the checkpoint's global tensors
    are what a world of one holds, the stacked experts transformers' [E, ...] layout."""
    from dsv4rl.train.megatron.convert import Ranks, Split, UnmappedTensor, merge, placement

    keys = {
        k: v for k, v in _tensor_keys(path).items() if _MEGATRON_MODEL.match(k) and "._extra_state" not in k
    }
    if not keys:
        raise ExportError(f"{path} holds no Megatron model tensors (decoder.*, embedding.*, output_layer.*)")
    for key, meta in keys.items():
        stacked = _STACKED_EXPERT.match(key)
        if stacked is not None:
            layer, which = stacked.groups()
            part = "gate_up_proj" if which == "1" else "down_proj"
            yield f"model.layers.{layer}.mlp.experts.{part}", _read_one(path, key, meta)
            continue
        try:
            where = placement(key, Ranks(), num_experts=1)
        except UnmappedTensor:
            raise ExportError(f"{path}: Megatron tensor {key!r} has no transformers counterpart") from None
        if where.split in (Split.expert_fc1, Split.expert_fc2):
            raise ExportError(f"{path}: {key!r} is a per-expert tensor; expected stacked experts")
        # one piece: the global tensor; the GLU rows hold [gate; up], the vocabulary its padding (no local
        # name keeps it: the next read must not find it alive)
        yield from zip(where.hf_names, merge([_read_one(path, key, meta)], where, vocab_size), strict=True)


def tensor_count(checkpoint: Checkpoint) -> int:
    """How many source tensors `checkpoint_tensors` yields (for the progress bar)."""
    keys = _tensor_keys(checkpoint.path)
    if checkpoint.backend == CheckpointBackend.megatron:
        return sum(1 for k in keys if _MEGATRON_MODEL.match(k) and "._extra_state" not in k)
    return sum(1 for k in keys if k.startswith("model."))


def checkpoint_tensors(checkpoint: Checkpoint, vocab_size: int) -> Iterator[tuple[str, torch.Tensor]]:
    if checkpoint.backend == CheckpointBackend.megatron:
        return megatron_tensors(checkpoint.path, vocab_size)
    return fsdp_tensors(checkpoint.path)


def trainer_counters(checkpoint: Checkpoint) -> dict:
    state = torch.load(checkpoint.path / TRAINER_STATE, weights_only=True)
    return {k: v for k, v in state.items() if isinstance(v, int | bool)}


def megatron_format(path: Path) -> dict:
    return json.loads((path / MEGATRON_METADATA).read_text())
