"""Routing and indexer replay in the megatron model (algo.routing_replay, algo.indexer_replay).

The micro-batch's choices travel with its token ids into `DeepseekV4Model.forward`; each block hands its
layer's slice to its score router (`ScoreRouter.replay`, the tokens of this tensor-parallel rank, as the
hash router gets its token ids) and to its CSA indexer (`Indexer.replay`) for the duration of its
forward, so a full-recompute rerun of the block sees them again. The router still weights the chosen
experts by its own scores (gradients flow); the indexer's selection has no gradient either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dsv4rl.model.replay import NO_CHOICE, ReplayCounts
from dsv4rl.train.megatron.sparse_attention import EntrySelection


@dataclass
class MicroChoices:
    """One micro-batch's rollout choices: routes [B, S, layers, top_k], topk [B, S, CSA layers, K]
    (None for a replay that is off), and where the decisions are counted."""

    routes: Tensor | None
    topk: Tensor | None
    counts: ReplayCounts | None = None


def selection_mask(selection: EntrySelection, entries: int) -> Tensor:
    """[B, S, entries] bool: the entries a top-k selection keeps."""
    batch, seq, _ = selection.indices.shape
    mask = torch.zeros(batch, seq, entries, dtype=torch.bool, device=selection.indices.device)
    if entries:
        mask.scatter_(-1, selection.indices, selection.valid)
    return mask


def replayed_selection(
    own: EntrySelection, replayed: Tensor, entries: int, counts: ReplayCounts | None
) -> EntrySelection:
    """The indexer's selection with the rollout's top-k where it has one: replayed [B, S, K] entry indices
    (-1 padding; NO_CHOICE rows keep `own`). Same shape as `own` ([B, S, min(topk, entries)]), indices
    distinct per query, the kept ones marked valid."""
    width = own.indices.shape[-1]
    mine = selection_mask(own, entries)
    replayed = replayed.to(mine.device).long()
    present = (replayed != NO_CHOICE).all(dim=-1)
    theirs = torch.zeros_like(mine)
    if entries:
        keep = (replayed >= 0) & (replayed < entries)
        # summed, not scattered: the -1 padding clamps onto entry 0, which a plain scatter could overwrite
        hits = torch.zeros(mine.shape, dtype=torch.int32, device=mine.device)
        hits.scatter_add_(-1, replayed.clamp(0, entries - 1), keep.to(torch.int32))
        theirs = (hits > 0) & present.unsqueeze(-1)
    mask = torch.where(present.unsqueeze(-1), theirs, mine)
    if counts is not None:
        counts.indexer_differ += int(((mine != mask).any(dim=-1) & present).sum())
        counts.indexer_total += int(present.sum())
    if width == 0:
        return own
    indices = mask.to(torch.float32).topk(width, dim=-1).indices  # the kept entries first, all distinct
    return EntrySelection(indices, mask.gather(-1, indices), own.ratio)
