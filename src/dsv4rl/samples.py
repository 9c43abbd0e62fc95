"""What a rollout produces: one sampled response with the engine's log-probs, then its reward."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class TurnRecord:
    """One assistant turn of a multi-turn trajectory, in response coordinates (0 = the first token after
    the prompt): the model's tokens are `[start, end)`, what the template inserted after them (tool
    results, the next turn's opening) `[end, inserted_end)`, with loss mask 0."""

    start: int
    end: int
    inserted_end: int
    finish_reason: str  # the engine's, for this turn
    calls: list[dict[str, Any]] = field(default_factory=list)  # each call: name, arguments, result, ...
    reward: float | None = None  # what the tools / environment gave this turn
    exception: dict[str, str] | None = None  # the environment's step raised: type, message, traceback


@dataclass
class CallCounts:
    """One tool's calls that ran (an environment's steps) and how many of them failed on the tool's side:
    it raised, or ran past the rollout's `timeout_s` (`dsv4rl.rollout.tool_failures`)."""

    calls: int = 0
    exceptions: int = 0
    timeouts: int = 0

    @property
    def failed(self) -> int:
        return self.exceptions + self.timeouts


@dataclass
class Trajectory:
    """What a multi-turn rollout (`rollout.mode` tools or env) adds to a sample."""

    turns: list[TurnRecord]
    messages: list[dict[str, Any]]  # the conversation, the last assistant turn included
    tool_calls: int = 0
    parse_errors: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    tool_time_s: float = 0.0
    tito_mismatches: int = 0  # renders that were not append-only
    retokenized_turns: int = 0  # turns whose rendered tokens differ from the sampled ones (kept as sampled)
    metrics: dict[str, float] = field(default_factory=dict)  # the tools' / environment's own numbers
    by_tool: dict[str, CallCounts] = field(default_factory=dict)  # per tool (`env`: the environment)

    @property
    def tool_exceptions(self) -> int:
        """Calls whose tool raised (environment steps that raised)."""
        return sum(counts.exceptions for counts in self.by_tool.values())

    @property
    def tool_rewards(self) -> list[float]:
        return [turn.reward for turn in self.turns if turn.reward is not None]


def head_version(versions: Sequence[str]) -> str:
    """The version of the first sampled token ("" where none was: inserted tokens carry "")."""
    return next((version for version in versions if version), "")


@dataclass
class Sample:
    group: int  # index of the prompt within the step; samples of one prompt share it
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]  # one per response token, as the engine sampled it
    response_text: str
    finish_reason: str  # "stop" | "length" | "abort"; multi-turn also "max_turns" | "tool_budget"
    answer: str = ""
    reward: float = 0.0
    advantage: float = 0.0
    # The version that sampled each response token ("" on tokens the template inserted): a response continued
    # across a weight update holds several (dsv4rl.rollout.versions).
    versions: list[str] = field(default_factory=list)
    excluded: bool = False  # no reward function scored it: no loss on it (TrainBatch masks it out)
    # The engine's choices (algo.routing_replay / indexer_replay), one row per forwarded position (prompt +
    # response - 1 rows), int32: routed experts [rows, layers * top_k], indexer top-k [rows, CSA layers *
    # index_topk]; the trainer reshapes them with the model's config.
    routed_experts: np.ndarray | None = None
    indexer_topk: np.ndarray | None = None
    # Multi-turn (rollout.mode tools / env): 1.0 on the model's own tokens, 0.0 on what the template
    # inserted (tool results, turn tokens); None: every response token is the model's (single turn).
    loss_mask: list[float] | None = None
    trajectory: Trajectory | None = None

    @property
    def weight_version(self) -> str:
        """The version that sampled its first token (its head version: the oldest policy in it)."""
        return head_version(self.versions)

    @property
    def generated_tokens(self) -> int:
        """The model's own tokens (the trajectory's length minus what was inserted)."""
        return len(self.response_ids) if self.loss_mask is None else int(sum(self.loss_mask))

    @property
    def final_turn_ids(self) -> list[int]:
        """The last assistant turn's tokens (the whole response in a single turn): what carries the answer."""
        if self.trajectory is None or not self.trajectory.turns:
            return self.response_ids
        last = self.trajectory.turns[-1]
        return self.response_ids[last.start : last.end]

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"
