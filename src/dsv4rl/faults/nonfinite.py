"""Non-finite values (NaN, Inf) where training cannot go on: the error that names them, the checks that
find them, and a test hook that puts them there.

The trainer skips an optimizer step whose loss or gradient norm is non-finite, up to
`train.max_nonfinite_steps` in a row (`dsv4rl.train.nonfinite`), and never pushes or checkpoints
non-finite weights; the weight sync refuses a non-finite tensor on its own as well (`dsv4rl.sync.pipeline`).
Each stop is a `NonFiniteError` naming the step, the phase and the first non-finite tensor.

`DSV4RL_INJECT_NONFINITE="<target>[:<step>]"` (several separated by commas) puts a NaN where a real run
would meet one, for end-to-end tests: `advantages` (one advantage of the train step's batch: the loss and
the gradients become NaN, the step is skipped) or `weights` (one weight after the train step: the weight
sync refuses it and the run stops). Without a step, every train step. Never set it outside tests.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from enum import StrEnum

import torch
from torch import Tensor

NONFINITE_ENV = "DSV4RL_INJECT_NONFINITE"
# Elements checked per kernel: a bounded temporary (a bool per element) for a layer's stacked experts.
CHUNK = 1 << 24


class NonFiniteError(RuntimeError):
    """A NaN or Inf stopped the run. `step` (None when not known), `phase` (`train`, `sync`, `checkpoint`)
    and `tensor` (`loss`, `the gradient of <parameter>`, `weight <name>`) say where it was found."""

    def __init__(self, step: int | None, phase: str, tensor: str, detail: str) -> None:
        self.step, self.phase, self.tensor, self.detail = step, phase, tensor, detail
        at = f"step {step}, " if step is not None else ""
        super().__init__(
            f"non-finite values at {at}phase {phase}: the first non-finite tensor is {tensor}; {detail}"
        )

    def __reduce__(self) -> tuple:  # pickled with its fields, not the message (another process re-raises it)
        return type(self), (self.step, self.phase, self.tensor, self.detail)


class InjectTarget(StrEnum):
    """Where `DSV4RL_INJECT_NONFINITE` puts a NaN."""

    advantages = "advantages"
    weights = "weights"


def parse_injections(text: str) -> list[tuple[InjectTarget, int | None]]:
    """`"advantages:2,weights:5"` -> [(advantages, 2), (weights, 5)]; ValueError names a malformed entry."""
    points = []
    for entry in filter(None, (part.strip() for part in text.split(","))):
        target, _, step = entry.partition(":")
        if target not in list(InjectTarget):
            raise ValueError(
                f"{NONFINITE_ENV}: {entry!r}: the target must be one of {', '.join(InjectTarget)}"
            )
        try:
            points.append((InjectTarget(target), int(step) if step else None))
        except ValueError:
            raise ValueError(f"{NONFINITE_ENV}: {entry!r}: the step must be an integer") from None
    return points


def injected(target: InjectTarget, step: int) -> bool:
    """Whether `DSV4RL_INJECT_NONFINITE` asks for a NaN in `target` at train step `step`."""
    text = os.environ.get(NONFINITE_ENV)
    return bool(text) and any(kind == target and at in (None, step) for kind, at in parse_injections(text))


# FP8 formats with NaN (and e5m2: Inf) encodings; torch has no isfinite for some of them on the CPU
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz)


def _finite_part(part: Tensor) -> Tensor:
    if part.dtype in FLOAT8:
        return torch.isfinite(part.float()).all()
    if part.dtype == torch.float8_e8m0fnu:  # block scales: 0xFF is its only non-finite code (NaN)
        return (part.view(torch.uint8) != 0xFF).all()
    if part.element_size() == 1:  # packed FP4 (e2m1 pairs): no NaN or Inf code exists
        return torch.ones((), dtype=torch.bool, device=part.device)
    return torch.isfinite(part).all()


def finite_flag(tensor: Tensor) -> Tensor:
    """A 0-d bool tensor on the tensor's device: True when every element is finite (integer tensors
    always are). Reading it is the only device sync."""
    if not tensor.is_floating_point():
        return torch.ones((), dtype=torch.bool, device=tensor.device)
    flat = tensor.detach().reshape(-1)
    if flat.numel() <= CHUNK:
        return _finite_part(flat)
    return torch.stack([_finite_part(part) for part in flat.split(CHUNK)]).all()


def all_finite(tensors: Iterable[Tensor]) -> bool:
    """Whether every element of every tensor is finite: one device sync per device, not per tensor."""
    by_device: dict[torch.device, list[Tensor]] = {}
    for tensor in tensors:
        by_device.setdefault(tensor.device, []).append(finite_flag(tensor))
    return all(bool(torch.stack(flags).all()) for flags in by_device.values())


def first_nonfinite(named: Iterable[tuple[str, Tensor]]) -> tuple[str, str] | None:
    """The name of the first tensor holding a NaN or Inf and what it holds (`describe`), or None. A device
    sync per tensor: for the search once a cheaper check found one."""
    for name, tensor in named:
        if not bool(finite_flag(tensor)):
            return name, describe(tensor)
    return None


def describe(tensor: Tensor) -> str:
    """What is non-finite in `tensor`: `NaN`, `Inf` or both, and how many of its elements."""
    values = tensor.detach().reshape(-1)
    if values.dtype == torch.float8_e8m0fnu:
        return f"NaN in {int((values.view(torch.uint8) == 0xFF).sum())} of {values.numel()} elements"
    if values.dtype in FLOAT8:
        values = values.float()
    nan = int(torch.isnan(values).sum())
    inf = int(torch.isinf(values).sum())
    kinds = " and ".join(kind for kind, count in (("NaN", nan), ("Inf", inf)) if count)
    return f"{kinds} in {nan + inf} of {values.numel()} elements"
