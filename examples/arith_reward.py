"""The tiny arithmetic task's check, written as a user's reward function (docs/tasks.md).

    dsv4rl train recipe=tiny_arith 'reward.fns=[{name: ok, target: examples/arith_reward.py:score}]'

learns as `reward.grader=arith` does: the same rule (the response starts with the right integer).
"""

from __future__ import annotations

import re

from dsv4rl.reward import RewardInput

LEADING_INTEGER = re.compile(r"-?\d+(?!\.\d)(?!\d)")


def score(sample: RewardInput) -> float:
    """1.0 when the answer starts with the reference integer ("7", "7 is it"), else 0.0."""
    match = LEADING_INTEGER.match((sample.answer or "").strip())
    return 1.0 if match is not None and match.group() == sample.ground_truth.strip() else 0.0
