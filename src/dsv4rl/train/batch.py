"""Training tensors built from rollout samples, aligned with next-token targets.

For `input_ids [B, T]` every per-token tensor is `[B, T-1]` and index t is about the target
`input_ids[:, t+1]`: response token k of a sample whose prompt has length P sits at input
position P+k, so at target index P-1+k. Padding is on the right; no attention mask is needed
because the model is causal (right padding does not change earlier positions).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields, replace

import numpy as np
import torch
from torch import Tensor

from dsv4rl.model.replay import NO_CHOICE
from dsv4rl.samples import Sample

PER_POSITION = ("routed_experts", "indexer_topk")  # [B, T, width]: one row per input position


@dataclass
class TrainBatch:
    input_ids: Tensor  # [B, T] long, right-padded with the pad id
    loss_mask: Tensor  # [B, T-1] float: 1.0 where the target is a token the model sampled
    advantages: Tensor  # [B] float
    rollout_logprobs: Tensor  # [B, T-1] float: the engine's logprobs of response targets, 0 elsewhere
    old_logprobs: Tensor | None = None  # [B, T-1]: the trainer's logprobs before the update
    ref_logprobs: Tensor | None = None  # [B, T-1]: the reference model's logprobs (KL penalty)
    # The engine's choices per input position (algo.routing_replay / indexer_replay), int32, NO_CHOICE
    # where the rollout reported none: [B, T, routed width] and [B, T, indexer width] (flat per position)
    routed_experts: Tensor | None = None
    indexer_topk: Tensor | None = None

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2 or self.input_ids.shape[1] < 2:
            raise ValueError(f"input_ids must be [B, T] with T >= 2, got {tuple(self.input_ids.shape)}")
        b, t = self.input_ids.shape
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or f.name == "input_ids":
                continue
            expected = (b,) if f.name == "advantages" else (b, t - 1)
            if f.name in PER_POSITION:
                expected = (b, t, value.shape[-1])
            if tuple(value.shape) != expected:
                raise ValueError(
                    f"TrainBatch.{f.name} has shape {tuple(value.shape)}, expected {expected} "
                    f"for input_ids {tuple(self.input_ids.shape)}"
                )

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @classmethod
    def from_samples(cls, samples: list[Sample], pad_id: int) -> TrainBatch:
        """Pack samples into right-padded tensors; advantages come from `Sample.advantage`."""
        if not samples:
            raise ValueError("TrainBatch.from_samples needs at least one sample")
        for i, s in enumerate(samples):
            if not s.prompt_ids:
                raise ValueError(f"sample {i} has an empty prompt: the first response token needs a context")
            if len(s.rollout_logprobs) != len(s.response_ids):
                raise ValueError(
                    f"sample {i} has {len(s.response_ids)} response tokens but "
                    f"{len(s.rollout_logprobs)} rollout logprobs; the engine must return one per token"
                )
        length = max(2, max(len(s.prompt_ids) + len(s.response_ids) for s in samples))
        # Padded Python rows, then one tensor each: a tensor per row costs more than the rows' contents.
        ids, mask, rollout = [], [], []
        for i, s in enumerate(samples):
            p, r = len(s.prompt_ids), len(s.response_ids)
            after = length - p - r
            ids.append(s.prompt_ids + s.response_ids + [pad_id] * after)
            on = 0.0 if s.excluded else 1.0  # a sample without a reward carries no loss
            own = [on] * r if s.loss_mask is None else [on * m for m in s.loss_mask]  # 0: inserted tokens
            if len(own) != r:
                raise ValueError(f"sample {i} has {r} response tokens but a loss mask of {len(own)}")
            mask.append([0.0] * (p - 1) + own + [0.0] * after)
            rollout.append([0.0] * (p - 1) + list(s.rollout_logprobs) + [0.0] * after)
        return cls(
            torch.tensor(ids, dtype=torch.long),
            torch.tensor(mask, dtype=torch.float32),
            torch.tensor([s.advantage for s in samples], dtype=torch.float32),
            torch.tensor(rollout, dtype=torch.float32),
            routed_experts=_per_position([s.routed_experts for s in samples], length, "routed_experts"),
            indexer_topk=_per_position([s.indexer_topk for s in samples], length, "indexer_topk"),
        )

    def select(self, index: slice | Tensor) -> TrainBatch:
        """Rows `index` of every tensor."""
        return replace(self, **{f.name: _rows(getattr(self, f.name), index) for f in fields(self)})

    def shard(self, rank: int, world: int, num_mini_batches: int = 1) -> TrainBatch:
        """This rank's contiguous share of the batch.

        With `num_mini_batches > 1` each mini-batch is sharded on its own (rank r gets the r-th
        slice of every mini-batch, concatenated), so mini-batch k of every rank together is
        exactly global mini-batch k and updates do not depend on the world size.
        """
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside world size {world}")
        if self.size % (world * num_mini_batches):
            raise ValueError(
                f"batch of {self.size} sequences does not split into {num_mini_batches} mini-batch(es) "
                f"x {world} rank(s); make prompts_per_step * group_size a multiple of "
                f"{world * num_mini_batches}"
            )
        mini = self.size // num_mini_batches
        per = mini // world
        if num_mini_batches == 1:
            return self.select(slice(rank * per, (rank + 1) * per))
        starts = [m * mini + rank * per for m in range(num_mini_batches)]
        return self.select(torch.cat([torch.arange(s, s + per) for s in starts]))

    def split(self, parts: int) -> list[TrainBatch]:
        """`parts` contiguous equal pieces (mini-batches)."""
        if parts < 1 or self.size % parts:
            raise ValueError(f"batch of {self.size} sequences does not split into {parts} equal parts")
        n = self.size // parts
        return [self.select(slice(i * n, (i + 1) * n)) for i in range(parts)]

    def micro_batches(self, size: int) -> Iterator[TrainBatch]:
        """Consecutive pieces of at most `size` sequences (the last may be smaller)."""
        if size < 1:
            raise ValueError(f"micro-batch size must be >= 1, got {size}")
        for start in range(0, self.size, size):
            yield self.select(slice(start, start + size))

    def trimmed_width(self) -> int:
        """How many target columns `trimmed()` keeps."""
        cols = self.loss_mask.any(dim=0).nonzero()
        return int(cols[-1]) + 1 if len(cols) else 1

    def trimmed(self, width: int | None = None) -> TrainBatch:
        """Drop trailing columns past the last response target: they carry no loss (saves compute).
        `width` (>= trimmed_width()) keeps that many target columns instead, e.g. one agreed by ranks."""
        keep = self.trimmed_width() if width is None else min(width, self.loss_mask.shape[1])
        if keep == self.loss_mask.shape[1]:
            return self
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or f.name == "advantages":
                out[f.name] = value
            else:
                per_input = f.name == "input_ids" or f.name in PER_POSITION
                out[f.name] = value[:, : keep + 1] if per_input else value[:, :keep]
        return TrainBatch(**out)

    def to(self, device: torch.device | str) -> TrainBatch:
        return replace(self, **{f.name: _move(getattr(self, f.name), device) for f in fields(self)})

    @property
    def num_tokens(self) -> int:
        """Response tokens (loss-bearing targets) in the batch."""
        return int(self.loss_mask.sum().item())


def _per_position(rows: list[np.ndarray | None], length: int, what: str) -> Tensor | None:
    """[B, length, width] int32 of the samples' per-position choices (row r = input position r), NO_CHOICE
    past each sample's rows; None when no sample has them."""
    if all(r is None for r in rows):
        return None
    if any(r is None for r in rows):
        raise ValueError(f"some samples carry {what} and some do not: the engines must all return it")
    widths = {r.shape[1] for r in rows}
    if len(widths) != 1:
        raise ValueError(f"samples carry {what} of different widths {sorted(widths)}: one model, one width")
    out = np.full((len(rows), length, widths.pop()), NO_CHOICE, dtype=np.int32)
    for index, r in enumerate(rows):
        out[index, : r.shape[0]] = r
    return torch.from_numpy(out)


def _rows(value: Tensor | None, index: slice | Tensor) -> Tensor | None:
    return None if value is None else value[index]


def _move(value: Tensor | None, device: torch.device | str) -> Tensor | None:
    return None if value is None else value.to(device)
