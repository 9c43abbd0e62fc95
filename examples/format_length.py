"""Shaping rewards to combine with a correctness grader by weights (examples/format_length.yaml):

    reward = 1.0 * builtin:dapo  +  0.2 * format  +  0.0 * length   (weight 0: logged, not trained on)

`format` checks the answer's shape (here: the response ends with an "Answer: <integer>" line, the line DAPO's
grader reads; `bare_integer` for the tiny model, which answers with one digit); `length` reports the
response's length relative to a budget, as a dict with the numbers to log beside the score.
"""

from __future__ import annotations

import re

from dsv4rl.reward import RewardInput

ANSWER_LINE = re.compile(r"Answer:\s*-?\d+\s*$")


def format_reward(sample: RewardInput, bare_integer: bool = False) -> float:
    """1.0 when the answer has the asked-for shape, 0.0 when not; None (no score) when there is no answer."""
    if sample.answer is None:
        return None  # the thinking never closed: nothing to judge the format of
    text = sample.answer.strip()
    if bare_integer:
        return 1.0 if re.fullmatch(r"-?\d+", text) else 0.0
    return 1.0 if ANSWER_LINE.search(text) else 0.0


def length(sample: RewardInput, budget: int = 1024) -> dict:
    """`score`: 1 within the token budget, falling linearly to 0 at twice the budget; plus the raw numbers."""
    tokens = len(sample.response_ids)
    over = max(0, tokens - budget)
    return {"score": max(0.0, 1.0 - over / budget), "tokens": tokens, "truncated": float(sample.truncated)}
