"""A reward that costs 50 ms a sample (bench/reward_overlap.py): the arithmetic check after a sleep, as a
verifier that runs code or a sandbox would take its time."""

from __future__ import annotations

import time

from dsv4rl.reward import RewardInput


def score(sample: RewardInput, seconds: float = 0.05) -> float:
    time.sleep(seconds)
    return 1.0 if (sample.answer or "").strip()[:1] == sample.ground_truth else 0.0
