"""A group reward: each sample scored against the other samples of its prompt (examples/group_reward.yaml).

`agreement` is test-time RL's self-consistency reward (TTRL, arXiv:2504.16084): the group's majority answer
stands in for the reference, and a sample scores 1.0 when it agrees with it. It needs no reference
answer, so it also works on unlabelled prompts. A group function (`group: true`) gets the list of one
prompt's samples and returns one result per sample, in order.
"""

from __future__ import annotations

from collections import Counter

from dsv4rl.reward import RewardInput


def agreement(samples: list[RewardInput], min_share: float = 0.0) -> list[dict | None]:
    """1.0 for the samples whose answer is the group's most common one, 0.0 for the others; None for a
    sample without an answer. `share`: how much of the group the majority holds (logged)."""
    answers = [s.answer.strip() if s.answer is not None else None for s in samples]
    counts = Counter(a for a in answers if a)
    if not counts:
        return [None] * len(samples)
    majority, votes = counts.most_common(1)[0]
    share = votes / len(samples)
    if share < min_share:  # no clear majority: no score for this group
        return [None] * len(samples)
    return [None if a is None else {"score": float(a == majority), "share": share} for a in answers]
