"""The unit every data source yields: a prompt, the reference answer a grader compares with, an id, and
once encoded the prompt's token ids."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Problem:
    prompt: str  # text given to the policy (before any chat template)
    answer: str  # ground truth handed to the grader
    id: str  # stable identifier (logs, eval tables)
    # The prompt as the model sees it, rendered in the recipe's chat format and tokenized once
    # (`dsv4rl.data.stream.encode_problems`); None: not yet encoded (rollout encodes it then).
    prompt_ids: tuple[int, ...] | None = None
    # Every other column of the data row, nested columns kept (reward functions read it as
    # `RewardInput.metadata`); not part of the problem's identity.
    metadata: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
