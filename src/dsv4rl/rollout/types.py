"""What a rollout produces: one sampled response with the engine's log-probs, then its reward."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Sample:
    group: int  # index of the prompt within the step; samples of one prompt share it
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]  # one per response token, as the engine sampled it
    response_text: str
    finish_reason: str  # "stop" | "length" | "abort"
    answer: str = ""
    reward: float = 0.0
    advantage: float = 0.0
    weight_version: str = ""
    excluded: bool = False  # no reward function scored it: no loss on it (TrainBatch masks it out)
    # The engine's choices (algo.routing_replay / indexer_replay), one row per forwarded position (prompt +
    # response - 1 rows), int32: routed experts [rows, layers * top_k], indexer top-k [rows, CSA layers *
    # index_topk]; the trainer reshapes them with the model's config.
    routed_experts: np.ndarray | None = None
    indexer_topk: np.ndarray | None = None

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"
