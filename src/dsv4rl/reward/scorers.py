"""How each kind of reward function is called for one group of samples: a builtin grader, a sync function
in the worker pool, an `async def` function on the trainer's event loop.

Every scorer returns, per sample and in order, what the call gave: a value, `TIMED_OUT` or a `CallFailed`;
`rewarder.settle` turns those into scores under the function's `on_error`. The remote service and the judge
are scorers too (`remote.py`, `judge.py`). Each call goes through the scorer's `watch`, which counts it
against the step's limits (`step_limits`; a no-op for a scorer used alone).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from dsv4rl.reward.fn_pool import AsyncProcessPool
from dsv4rl.reward.fn_worker import call_target
from dsv4rl.reward.graders import Grader, PooledGrader
from dsv4rl.reward.inputs import RewardInput
from dsv4rl.reward.results import TIMED_OUT, CallFailed, FnSpec, call_failed
from dsv4rl.reward.step_limits import NO_WATCH, FunctionWatch
from dsv4rl.targets import Target


class Scorer(Protocol):
    spec: FnSpec
    watch: FunctionWatch  # the RewardSet's: each call counted against the step's limits

    async def score(self, samples: Sequence[RewardInput]) -> list[Any]:
        """One result per sample: a value, TIMED_OUT or CallFailed."""
        ...

    def close(self) -> None: ...


def split_group(raw: Any, n: int) -> list[Any]:
    """A group function's result as one result per sample (a failure counts for every sample)."""
    if raw is TIMED_OUT or isinstance(raw, CallFailed):
        return [raw] * n
    if not isinstance(raw, list | tuple) or len(raw) != n:
        got = f"{len(raw)} results" if isinstance(raw, list | tuple) else f"{type(raw).__name__} {raw!r:.60}"
        failed = CallFailed(
            "BadResult",
            f"a group function must return a list of {n} results (one per sample, in order); got {got}",
        )
        return [failed] * n
    return list(raw)


class BuiltinScorer:
    """One of dsv4rl's graders on the samples' answers: in this process (the rule graders are linear-time),
    math-verify in its own pool. A sample without an answer (thinking never closed) is graded incorrect."""

    watch = NO_WATCH

    def __init__(self, spec: FnSpec, grader: Grader) -> None:
        self.spec, self.grader = spec, grader

    async def score(self, samples: Sequence[RewardInput]) -> list[Any]:
        incorrect = float(getattr(self.grader, "incorrect", 0.0))
        out: list[Any] = [incorrect] * len(samples)
        present = [i for i, s in enumerate(samples) if s.answer is not None]
        if isinstance(self.grader, PooledGrader):
            answers = [samples[i].answer for i in present]
            truths = [samples[i].ground_truth for i in present]
            round_ = await self.watch.call(
                asyncio.to_thread(self.grader.run, answers, truths, False),
                len(present),
                timeouts=lambda pool_round: sum(r is TIMED_OUT for r in pool_round.results),
            )
            for i, result in zip(present, round_.results, strict=True):
                out[i] = result if result is TIMED_OUT or isinstance(result, CallFailed) else result[0]
            return out
        for i in present:
            try:
                out[i] = self.grader.grade(samples[i].answer, samples[i].ground_truth)
            except Exception as error:
                out[i] = call_failed(error)
        return out

    def close(self) -> None:
        close = getattr(self.grader, "close", None)
        if close is not None:
            close()


class PoolScorer:
    """A sync function, called in the shared worker pool: one call per sample, or per group."""

    watch = NO_WATCH

    def __init__(self, spec: FnSpec, target: Target, kwargs: dict[str, Any], pool: AsyncProcessPool) -> None:
        self.spec, self.target, self.kwargs, self.pool = spec, target, dict(kwargs), pool

    async def score(self, samples: Sequence[RewardInput]) -> list[Any]:
        timeout = self.spec.timeout_s
        if self.spec.group:
            call = self.pool.call(call_target, (self.target, list(samples), self.kwargs), timeout)
            return split_group(await self.watch.call(call, len(samples)), len(samples))
        calls = [self.pool.call(call_target, (self.target, s, self.kwargs), timeout) for s in samples]
        return list(await asyncio.gather(*(self.watch.call(call) for call in calls)))

    def close(self) -> None:  # the pool is the reward set's
        pass


class AsyncScorer:
    """An `async def` function on the trainer's event loop, at most `limit` calls in flight (all async
    functions together), each under its timeout. It must not block the loop: CPU work belongs in a sync
    function (the worker pool)."""

    watch = NO_WATCH

    def __init__(
        self, spec: FnSpec, function: Callable[..., Any], kwargs: dict[str, Any], limit: asyncio.Semaphore
    ) -> None:
        self.spec, self.function, self.kwargs, self.limit = spec, function, dict(kwargs), limit

    async def _one(self, payload: Any) -> Any:
        async with self.limit:
            try:
                return await asyncio.wait_for(self.function(payload, **self.kwargs), self.spec.timeout_s)
            except TimeoutError:
                return TIMED_OUT
            except Exception as error:
                return call_failed(error)

    async def score(self, samples: Sequence[RewardInput]) -> list[Any]:
        if self.spec.group:
            return split_group(await self.watch.call(self._one(list(samples)), len(samples)), len(samples))
        return list(await asyncio.gather(*(self.watch.call(self._one(s)) for s in samples)))

    def close(self) -> None:
        pass
