"""`train.freeze` in a trainer backend: the chosen tensors never change.

`freeze` runs when a backend has loaded its policy model, before it wraps the model (FSDP2, megatron's DDP)
and builds the optimizer: each frozen parameter gets `requires_grad=False`, so no wrapper gives it a
gradient buffer, no optimizer holds it (no Adam state, no weight decay: `dsv4rl.train.weight_decay`
groups only trainable parameters, megatron's `_get_param_groups` the same), and the gradient norm and its
clipping never see it. Frozen tensors stay in the model: the weight sync pushes them and checkpoints hold
them like every other tensor. Buffers (the routers' score-correction bias) have no gradient and no
optimizer to begin with; freezing one makes it part of the check below and of the log line.

The selection is agreed over every rank (a pipeline stage sees only its own layers): an entry that matches
no tensor anywhere is refused on every rank, before step 1, as is a selection that leaves a rank nothing
to train. Rank 0 logs once what each entry froze, in transformers' tensors and elements.

The backend keeps a fingerprint of each frozen tensor of its own shards (`FrozenTensors.snapshot`) and
checks it before every checkpoint (`FrozenTensors.check`): a frozen tensor that changed anyway (an update
path nobody expected) stops the run, naming it, rather than reaching a checkpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from dsv4rl.model.freeze import FreezeEntry, FreezeError, matching_entries, parse_entries, unmatched_message
from dsv4rl.train.nonfinite import first_across_ranks

log = logging.getLogger(__name__)
_CHUNK = 1 << 20  # 16-bit pieces widened to int64 at a time while fingerprinting


class FrozenTensorChanged(RuntimeError):
    """A tensor `train.freeze` keeps fixed has changed: something updated it anyway."""


@dataclass
class _Share:
    """What one rank found: per entry the transformers names it froze and their elements (counted on the
    rank that holds the counted copy), the elements of its part of the model, what it cannot freeze."""

    names: dict[str, set[str]] = field(default_factory=dict)
    elements: dict[str, int] = field(default_factory=dict)
    frozen_elements: int = 0
    total_elements: int = 0
    trainable: int = 0
    partial: dict[str, list[str]] = field(default_factory=dict)  # entry -> tensors it matches a part of
    everything_frozen: bool = False


@dataclass(frozen=True)
class EntryCount:
    tensors: int  # transformers tensors (a stacked expert tensor counts once)
    elements: int


def _all_shares(share: _Share) -> list[_Share]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [share]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, share)
    return every


def fingerprint(tensor: Tensor) -> tuple[int, int]:
    """Two sums over the tensor's bits, read as 16-bit integers: the plain sum, which any change of one
    element changes, and one weighted by position, which a permutation (rows in another order) changes too.
    Exact integer sums (no overflow: 2^20 pieces of 2^15 times weights under 2^16 per chunk), so equal
    tensors always agree, on any device."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.int8)
    flat = flat.view(torch.int16 if flat.element_size() >= 2 else torch.int8)
    plain = weighted = 0
    for start in range(0, flat.numel(), _CHUNK):
        wide = flat[start : start + _CHUNK].to(torch.int64)
        weights = torch.arange(start, start + wide.numel(), dtype=torch.int64, device=wide.device) % 65521 + 1
        plain += int(wide.sum())
        weighted += int((wide * weights).sum())
    return plain, weighted


class FrozenTensors:
    """The frozen tensors of this rank, by the backend's own names, and what each entry froze overall."""

    def __init__(
        self,
        names: dict[str, tuple[str, ...]] | None = None,
        counts: dict[str, EntryCount] | None = None,
        frozen_elements: int = 0,
        everywhere: frozenset[str] = frozenset(),
    ) -> None:
        self.names = names or {}  # this rank's frozen tensors: backend name -> the entries that froze it
        self.counts = counts or {}  # entry -> over the whole model
        self.frozen_elements = frozen_elements
        self.everywhere = everywhere  # every frozen tensor of the model, by transformers' names
        self._fingerprints: dict[str, tuple[int, int]] = {}

    def __bool__(self) -> bool:
        return bool(self.counts)

    def snapshot(self, local_weights: Iterable[tuple[str, Tensor]]) -> None:
        """Fingerprint this rank's frozen tensors as they are now (the model as wrapped: its shards)."""
        self._fingerprints = {
            name: fingerprint(tensor) for name, tensor in local_weights if name in self.names
        }
        missing = sorted(set(self.names) - set(self._fingerprints))
        if missing:
            raise RuntimeError(f"the frozen tensors {missing[:5]} are not among this rank's weights")

    def check(self, local_weights: Iterable[tuple[str, Tensor]], when: str) -> None:
        """Collective: raise `FrozenTensorChanged` on every rank when a frozen tensor of any rank differs
        from its snapshot."""
        if not self:
            return
        changed = next(
            (
                (name, "frozen by train.freeze=" + "/".join(self.names[name]))
                for name, tensor in local_weights
                if name in self._fingerprints and fingerprint(tensor) != self._fingerprints[name]
            ),
            None,
        )
        found = first_across_ranks(changed)
        if found is not None:
            raise FrozenTensorChanged(
                f"{found} changed during training ({when}): a frozen tensor must stay as loaded; nothing "
                "was written"
            )


def freeze(
    tensors: Iterable[tuple[str, Tensor]],
    entries: Sequence[str],
    transformers_names: Callable[[str], Sequence[str]],
    counted_once: Callable[[Tensor], bool],
) -> FrozenTensors:
    """Collective: freeze the tensors of `tensors` (the model's parameters as `Parameter`s and persistent
    buffers, by the backend's names) that an entry of `train.freeze` selects. `transformers_names` gives the
    transformers tensor(s) a backend tensor holds; `counted_once` whether this rank's copy counts in the
    model's totals (the others are replicas or shards counted elsewhere). FreezeError (on every rank) for
    an entry that matches nothing, a backend tensor an entry matches only part of, or a rank left with
    nothing to train."""
    rules = parse_entries(entries)
    if not rules:  # the same on every rank: no collective
        return FrozenTensors()
    share, frozen = _Share(), {}
    for name, tensor in tensors:
        names = tuple(transformers_names(name))
        whole, partial = matching_entries(rules, names)
        counted = tensor.numel() if counted_once(tensor) else 0
        share.total_elements += counted
        for text in partial:
            share.partial.setdefault(text, []).append(f"{name} = {' + '.join(names)}")
        is_parameter = isinstance(tensor, torch.nn.Parameter)
        if not whole:
            if is_parameter and tensor.requires_grad:
                share.trainable += 1
            continue
        if is_parameter:
            tensor.requires_grad_(False)
        frozen[name] = tuple(whole)
        share.frozen_elements += counted
        for text in whole:
            share.names.setdefault(text, set()).update(names)
            share.elements[text] = share.elements.get(text, 0) + counted
    share.everything_frozen = not share.trainable
    shares = _all_shares(share)
    problems = _problems(rules, shares)
    if problems:
        raise FreezeError("; ".join(problems))
    counts = {
        rule.text: EntryCount(
            len(set().union(*(one.names.get(rule.text, set()) for one in shares))),
            sum(one.elements.get(rule.text, 0) for one in shares),
        )
        for rule in rules
    }
    everywhere = frozenset().union(*(names for one in shares for names in one.names.values()))
    result = FrozenTensors(frozen, counts, sum(one.frozen_elements for one in shares), everywhere)
    if not dist.is_initialized() or dist.get_rank() == 0:
        total = sum(one.total_elements for one in shares)
        log.info("%s", describe(result, total))
    return result


def _problems(rules: Sequence[FreezeEntry], shares: Sequence[_Share]) -> list[str]:
    problems = []
    partial = {rule.text: [t for one in shares for t in one.partial.get(rule.text, [])] for rule in rules}
    unmatched = [
        rule.text
        for rule in rules
        if not partial[rule.text] and not any(rule.text in one.names for one in shares)
    ]
    if unmatched:
        problems.append(unmatched_message(unmatched))
    for text, tensors in partial.items():
        if tensors:
            more = f" (and {len(tensors) - 1} more)" if len(tensors) > 1 else ""
            problems.append(
                f"train.freeze entry {text!r} matches only a part of what one tensor of this trainer backend "
                f"holds: {tensors[0]}{more}; an entry must match all of a tensor's parts or none"
            )
    stuck = [rank for rank, one in enumerate(shares) if one.everything_frozen]
    if stuck:
        whose = "the model" if len(shares) == 1 else f"the share of the model on rank(s) {stuck}"
        problems.append(f"train.freeze freezes every parameter of {whose}: nothing would train")
    return problems


def describe(frozen: FrozenTensors, total_elements: int) -> str:
    """The log line: what each entry froze, and the share of the model's elements kept fixed."""
    parts = [
        f"{text}: {count.tensors} tensors, {count.elements:,} elements"
        for text, count in frozen.counts.items()
    ]
    share = frozen.frozen_elements / total_elements if total_elements else 0.0
    return (
        f"train.freeze keeps {frozen.frozen_elements:,} of {total_elements:,} elements fixed ({share:.4%}): "
        + "; ".join(parts)
    )
