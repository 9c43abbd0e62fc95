"""The unit every data source yields: a prompt, the reference answer a grader compares with, an id."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    prompt: str  # text given to the policy (before any chat template)
    answer: str  # ground truth handed to the grader
    id: str  # stable identifier (logs, eval tables)
