"""The engine's routing and indexer choices on each rollout sample (algo.routing_replay,
algo.indexer_replay): what each /generate asks for, and how the answer's fields land on the sample."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from dsv4rl.samples import Sample
from dsv4rl.wire.choices import decode_rows


@dataclass(frozen=True)
class ChoiceRequest:
    """Which engine choices each /generate asks for."""

    routed_experts: bool = False
    indexer_topk: bool = False

    def generate_kwargs(self) -> dict[str, bool]:
        """EngineAPI.generate's keyword arguments (none when nothing is asked, so plain requests stay as
        they were)."""
        out = {}
        if self.routed_experts:
            out["return_routed_experts"] = True
        if self.indexer_topk:
            out["return_indexer_topk"] = True
        return out


def _rows(meta: dict, key: str, rows: int, flag: str) -> np.ndarray:
    if key not in meta:
        raise ValueError(
            f"the engine answered without meta_info[{key!r}]: start it with {flag} (SGLang drops the field "
            "silently without it); dsv4rl's planner adds the flag when the replay is on"
        )
    return decode_rows(meta[key], rows, key)


def attach_choices(sample: Sample, meta: dict[str, Any], asked: ChoiceRequest | None) -> Sample:
    """Keep the answer's choices on `sample`: one row per forwarded position (prompt + response - 1, from
    position 0), flat per row; the trainer reshapes them with the model's config."""
    if asked is None:
        return sample
    rows = len(sample.prompt_ids) + len(sample.response_ids) - 1
    if asked.routed_experts:
        sample.routed_experts = _rows(meta, "routed_experts", rows, "--enable-return-routed-experts")
    if asked.indexer_topk:
        sample.indexer_topk = _rows(meta, "indexer_topk", rows, "--enable-return-indexer-topk")
    return sample
