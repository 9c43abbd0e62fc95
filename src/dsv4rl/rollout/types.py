"""What a rollout produces: one sampled response with the engine's log-probs, then its reward."""

from __future__ import annotations

from dataclasses import dataclass


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

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"
