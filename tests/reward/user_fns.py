"""Reward functions the tests load by file target (`tests/reward/user_fns.py:name`), as a user writes them."""

from __future__ import annotations

import asyncio
import os
import time

from dsv4rl.reward import RewardInput


def ok(sample: RewardInput) -> float:
    return 1.0 if (sample.answer or "").strip()[:1] == sample.ground_truth else 0.0


def sleepy(sample: RewardInput, delay: float = 5.0, every: int = 4) -> dict:
    """Sleeps `delay` seconds on every `every`-th sample (past any short timeout)."""
    if sample.index % every == 0:
        time.sleep(delay)
    return {"score": 1.0, "length": len(sample.response)}


def raises(sample: RewardInput, every: int = 2) -> float:
    if sample.index % every == 1:
        raise ZeroDivisionError("raised on purpose")
    return 0.5


def nothing(sample: RewardInput) -> None:
    return None


def ranks(samples: list[RewardInput]) -> list[float]:
    """A group function: each sample's place in its group."""
    return [float(i) for i in range(len(samples))]


def short_group(samples: list[RewardInput]) -> list[float]:
    return [1.0] * (len(samples) - 1)


async def async_ok(sample: RewardInput, bonus: float = 0.0) -> float:
    await asyncio.sleep(0)
    return 1.0 + bonus


async def async_slow(sample: RewardInput) -> float:
    await asyncio.sleep(10)
    return 1.0


def dies(sample: RewardInput) -> float:
    os._exit(3)


def returns_text(sample: RewardInput) -> str:
    return "seven"


def no_sample() -> float:  # wrong signature: takes no sample
    return 1.0


def number_in_brackets(reply: str) -> float | None:
    """A judge's parse function: the number in [[...]]."""
    start, end = reply.find("[["), reply.find("]]")
    return float(reply[start + 2 : end]) if 0 <= start < end else None
