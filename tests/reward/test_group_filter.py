"""The stream's group filter (`algo.oversample.filter`): DAPO's built in, a user's function in a worker
process of its own, and every way a user's filter can fail stopping the run with the reason."""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path

import pytest

from dsv4rl.config.schema import OversampleConfig
from dsv4rl.reward.group_filter import FilterError, GroupFilter, nonzero_std
from dsv4rl.reward.inputs import RewardInput

FILTERS = """
import os, time

def long_enough(group, rewards, min_chars=3):
    return all(len(sample.response) >= min_chars for sample in group) and max(rewards) > 0

def where(group, rewards):
    return os.getpid()

def broken(group, rewards):
    raise KeyError("no such column")

def slow(group, rewards):
    time.sleep(30)
    return True
"""


def group(*responses: str) -> list[RewardInput]:
    return [RewardInput(prompt="1+1=", response=text, answer=text, ground_truth="2") for text in responses]


def test_the_builtin_keeps_groups_whose_rewards_differ() -> None:
    assert nonzero_std(group("2", "3"), [1.0, 0.0])
    assert not nonzero_std(group("2", "2"), [1.0, 1.0])
    keep = GroupFilter.from_config(OversampleConfig(filter="builtin:nonzero_std"), ())
    assert keep.pool is None  # ours: runs in the trainer's process
    assert asyncio.run(keep.keep(group("2", "3"), [0.0, 1.0]))
    assert GroupFilter.from_config(OversampleConfig(), ()) is None


def test_a_users_filter_runs_in_a_worker_and_fails_loudly(tmp_path: Path) -> None:
    (tmp_path / "filters.py").write_text(textwrap.dedent(FILTERS))

    def made(name: str, timeout_s: float = 10.0) -> GroupFilter:
        return GroupFilter.from_config(
            OversampleConfig(filter=f"filters.py:{name}", timeout_s=timeout_s), [tmp_path]
        )

    async def scenario() -> None:
        keep = made("long_enough")
        try:
            await keep.start()
            assert await keep.keep(group("two", "2+0"), [1.0, 0.0])
            assert not await keep.keep(group("2", "two"), [1.0, 0.0])  # too short
            assert not await keep.keep(group("two", "two"), [0.0, 0.0])
        finally:
            keep.close()
        for name, timeout_s, message in (
            ("where", 10.0, "returned"),  # not a bool
            ("broken", 10.0, "raised KeyError: 'no such column'"),
            ("slow", 0.5, "ran past algo.oversample.timeout_s=0.5"),
        ):
            failing = made(name, timeout_s)
            try:
                with pytest.raises(FilterError, match=message) as raised:
                    await failing.keep(group("2", "3"), [1.0, 0.0])
                assert f"filters.py:{name}" in str(raised.value)
                if name == "broken":
                    assert "Traceback" in str(raised.value)  # the worker's, for the user
            finally:
                failing.close()

    asyncio.run(scenario())
