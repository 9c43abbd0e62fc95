"""The reference engine's side of `/update_weights_from_tensor`: tensors a colocated trainer handed over.

SGLang 0.5.23 (`srt/managers/scheduler_components/weight_updater.py`, `srt/managers/tp_worker.py` and
`srt/model_executor/model_runner_components/weight_updater.py`): the call is refused outside a weight-update
session; TP rank i unpickles entry i of `serialized_named_tensors`; `load_format` null loads through the
model's name remapping, "direct" by parameter name, "flattened_bucket" rebuilds the tensors from one
buffer, and anything else is a custom loader or a NotImplementedError; then the cache is flushed when asked
and the weight version set. Its success message is "Success", plus " Weight version updated to X.".

The reference engine is stricter: exactly one entry per TP rank; the payload must unpickle (allow-listed,
`dsv4rl.wire.tensor_payload`) to what its load_format promises; the engine must hold exactly those names,
dtypes and shapes (`HeldWeights.plan`); every check runs before anything is written, and the tensors are
copied out of the trainer's shared memory before the call answers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dsv4rl.engine.weight_store import HeldWeights
from dsv4rl.wire.layout import dtype_name
from dsv4rl.wire.tensor_payload import LOAD_FORMATS, PayloadError, deserialize, named_tensors

__all__ = ["RELEASED", "SUCCESS", "receive_tensors"]

SUCCESS = "Success"
RELEASED = (
    'the engine\'s weights are released: call /resume_memory_occupation with tags ["weights"] before '
    "updating them"
)


def receive_tensors(
    held: HeldWeights, serialized: Sequence[str], load_format: str | None, tp_size: int = 1
) -> dict[str, torch.Tensor]:
    """This rank's tensors of an update, checked against what `held` holds and copied to private memory.
    ValueError names the first problem; nothing is written here (the caller commits)."""
    if held.released:
        raise ValueError(RELEASED)
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"Unknown load_format={load_format} (the reference engine has no custom weight loaders); "
            f"use one of {list(LOAD_FORMATS)}"
        )
    if len(serialized) != tp_size:
        raise ValueError(
            f"serialized_named_tensors has {len(serialized)} entries, but the engine has {tp_size} "
            "tensor-parallel rank(s): send one per rank"
        )
    try:
        pairs = named_tensors(deserialize(serialized[0]), load_format)
    except PayloadError as error:
        raise ValueError(f"serialized_named_tensors[0]: {error}") from None
    held.plan(
        [name for name, _ in pairs],
        [dtype_name(tensor.dtype) for _, tensor in pairs],
        [list(tensor.shape) for _, tensor in pairs],
    )
    return {name: tensor.detach().cpu().clone() for name, tensor in pairs}
