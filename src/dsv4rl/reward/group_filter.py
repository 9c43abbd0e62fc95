"""Which finished groups the fully asynchronous stream keeps (`algo.oversample.filter`): a plain function a
user writes in minutes, or DAPO's built in.

    def keep(group: list[RewardInput], rewards: list[float]) -> bool: ...

`group` is the prompt's samples as the reward functions saw them, `rewards` what the recipe's reward gave
each (shaped). Named like a reward function (`builtin:nonzero_std`, `pkg.module:fn`, `path/file.py:fn`).
A user's filter runs in a worker process of its own, under `algo.oversample.timeout_s`; one that raises,
runs past its time or returns anything but a bool stops the run with its traceback: a filter that fails
would otherwise decide silently what the model trains on.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from dsv4rl.config.schema import OversampleConfig
from dsv4rl.reward.fn_pool import AsyncProcessPool
from dsv4rl.reward.fn_worker import call_target
from dsv4rl.reward.inputs import RewardInput
from dsv4rl.reward.results import TIMED_OUT, CallFailed
from dsv4rl.targets import Target, parse, resolve

# builtin:<name> -> where it lives
FILTERS = {"nonzero_std": "dsv4rl.reward.group_filter:nonzero_std"}


class FilterError(RuntimeError):
    """The recipe's group filter failed: the run stops (the message names the filter and the fix)."""


def nonzero_std(group: Sequence[RewardInput], rewards: Sequence[float]) -> bool:
    """DAPO's filter (Miles' `check_reward_nonzero_std`): keep a group whose rewards are not all equal, the
    only groups whose advantages are not all zero."""
    return len(set(rewards)) > 1


def parse_filter(spec: str, base_dirs: Sequence[Path]) -> Target:
    """`algo.oversample.filter` as a target (TargetError naming the fix)."""
    return parse(spec, base_dirs, FILTERS, role="algo.oversample.filter", builtin_noun="filter")


class GroupFilter:
    """The recipe's filter: a builtin runs here, a user's function in its own worker process."""

    def __init__(self, target: Target, timeout_s: float) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self.builtin = resolve(target) if target.kind == "builtin" else None
        self.pool = None if self.builtin else AsyncProcessPool(1, [target], label="rollout filter")

    @classmethod
    def from_config(cls, cfg: OversampleConfig, base_dirs: Sequence[Path]) -> GroupFilter | None:
        if not cfg.filter:
            return None
        return cls(parse_filter(cfg.filter, base_dirs), cfg.timeout_s)

    async def start(self) -> None:
        """The worker imports the user's module now, not in the first step."""
        if self.pool is not None:
            await self.pool.start()

    async def keep(self, group: Sequence[RewardInput], rewards: Sequence[float]) -> bool:
        if self.builtin is not None:
            return bool(self.builtin(list(group), list(rewards)))
        payload = (self.target, list(group), {"rewards": [float(r) for r in rewards]})
        answer = await self.pool.call(call_target, payload, self.timeout_s)
        spec = self.target.spec
        if answer is TIMED_OUT:
            raise FilterError(
                f"algo.oversample.filter {spec!r} ran past algo.oversample.timeout_s={self.timeout_s:g} on a "
                "group: make it faster or raise the timeout"
            )
        if isinstance(answer, CallFailed):
            raised = f"{answer.error_type}: {answer.message}"
            raise FilterError(f"algo.oversample.filter {spec!r} raised {raised}\n{answer.traceback}")
        if not isinstance(answer, bool):
            raise FilterError(
                f"algo.oversample.filter {spec!r} returned {answer!r:.60} ({type(answer).__name__}); it must "
                "return True (keep the group) or False"
            )
        return answer

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
