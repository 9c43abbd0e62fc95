"""The recipe's reward as one object: every function of `reward.fns` (or the `reward.grader` short form),
the remote service and the judge, scored group by group on the trainer's event loop.

`RewardSet.from_config(cfg.reward, base_dirs)` builds the scorers (the user's modules are imported here to
see which functions are `async def`; sync ones are only ever called in the worker pool);
`await rewards.score_group(samples)` gives each sample's `Outcome` per function, the loop calls it for each
prompt's group as soon as the group's samples are back; `combine` / `check_error_fraction` (combine.py)
turn a step's outcomes into rewards and metrics. `begin_round` / `start_deadline` / `end_round` put a
round's calls under the step's limits (`step_limits`: too many timeouts, a scoring that never ends).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from dsv4rl.config.schema import RewardConfig, RewardFnConfig
from dsv4rl.reward.combine import Combined, check_error_fraction, check_timeout_fraction, combine, settle
from dsv4rl.reward.fn_pool import AsyncProcessPool
from dsv4rl.reward.graders import GRADERS, Grader, PooledGrader, get_grader, grader_options
from dsv4rl.reward.inputs import RewardInput
from dsv4rl.reward.judge import JudgeScorer
from dsv4rl.reward.remote import RemoteScorer
from dsv4rl.reward.results import FnSpec, Outcome, RewardError
from dsv4rl.reward.scorers import AsyncScorer, BuiltinScorer, PoolScorer, Scorer
from dsv4rl.reward.step_limits import StepWatch
from dsv4rl.targets import BUILTIN, is_async, parse, resolve


def effective_fns(cfg: RewardConfig) -> list[RewardFnConfig]:
    """`reward.fns`, or the short form (`reward.grader: X` = one builtin with weight 1) when no other
    reward is set (fns, remote and judge all empty)."""
    if cfg.fns or cfg.remote.url or cfg.judge.base_url:
        return list(cfg.fns)
    return [RewardFnConfig(name=str(cfg.grader), target=f"{BUILTIN}{cfg.grader}", weight=1.0)]


def function_names(cfg: RewardConfig) -> list[str]:
    """Every reward function's name, in order (metrics keys reward/<name>/...)."""
    names = [fn.name for fn in effective_fns(cfg)]
    names += [cfg.remote.name] if cfg.remote.url else []
    return names + ([cfg.judge.name] if cfg.judge.base_url else [])


def builtin_grader(fn: RewardFnConfig, cfg: RewardConfig, name: str) -> Grader:
    """The grader a `builtin:` function names, its kwargs as the grader's options (ValueError if unknown)."""
    kwargs = dict(fn.kwargs)
    if fn.timeout_s is not None and "timeout_s" in grader_options(name):
        kwargs.setdefault("timeout_s", fn.timeout_s)
    return get_grader(name, reward=cfg, **kwargs)


@dataclass
class Scored:
    """One group's verdicts: per sample, each function's `Outcome` by name."""

    outcomes: list[dict[str, Outcome]]


class RewardSet:
    """The scorers of a recipe's reward, and the worker pool their sync functions share."""

    def __init__(
        self,
        scorers: Sequence[Scorer],
        pool: AsyncProcessPool | None,
        max_error_fraction: float,
        max_timeout_fraction: float = RewardConfig.max_timeout_fraction,
        step_timeout_s: float = RewardConfig.step_timeout_s,
    ):
        self.scorers = list(scorers)
        self.pool = pool
        self.max_error_fraction = max_error_fraction
        self.limits = StepWatch(max_timeout_fraction, step_timeout_s)
        for scorer in self.scorers:
            scorer.watch = self.limits.watch(scorer.spec)
        self._restarts_seen = 0
        # Whether the last round's scoring was slow enough to overlap with generation (train/rewarding.py)
        self.overlap = False

    @classmethod
    def from_config(cls, cfg: RewardConfig, base_dirs: Sequence[Path]) -> RewardSet:
        """Build every scorer; the targets were checked before start (dsv4rl.checks.reward), a failure here
        raises TargetError naming it."""
        dirs = list(base_dirs)
        scorers: list[Scorer] = []
        pooled = []
        limit = asyncio.Semaphore(max(1, cfg.async_concurrency))
        for fn in effective_fns(cfg):
            timeout = fn.timeout_s if fn.timeout_s is not None else cfg.timeout_s
            spec = FnSpec(fn.name, fn.target, fn.weight, fn.on_error, timeout, fn.group)
            target = parse(fn.target, dirs, GRADERS, builtin_noun="grader")
            if target.kind == "builtin":
                grader = builtin_grader(fn, cfg, target.builtin)
                spec = replace(spec, zero=float(getattr(grader, "incorrect", 0.0)))
                scorers.append(BuiltinScorer(spec, grader))
                continue
            function = resolve(target)
            if is_async(function):
                scorers.append(AsyncScorer(spec, function, fn.kwargs, limit))
            else:
                pooled.append((spec, target, fn.kwargs))
        pool = None
        if pooled:
            pool = AsyncProcessPool(cfg.num_workers, [t for _, t, _ in pooled], label="reward function")
            scorers += [PoolScorer(spec, target, kwargs, pool) for spec, target, kwargs in pooled]
            order = {fn.name: i for i, fn in enumerate(effective_fns(cfg))}
            scorers.sort(key=lambda s: order.get(s.spec.name, len(order)))
        if cfg.remote.url:
            r = cfg.remote
            scorers.append(RemoteScorer(FnSpec(r.name, r.url, r.weight, r.on_error, r.timeout_s), r))
        if cfg.judge.base_url:
            j = cfg.judge
            spec = FnSpec(j.name, f"judge {j.model} at {j.base_url}", j.weight, j.on_error, j.timeout_s)
            scorers.append(JudgeScorer(spec, j, dirs))
        return cls(scorers, pool, cfg.max_error_fraction, cfg.max_timeout_fraction, cfg.step_timeout_s)

    async def start(self) -> None:
        """Start the worker pool before the first step (its imports are paid for here)."""
        if self.pool is not None:
            await self.pool.start()

    @property
    def specs(self) -> list[FnSpec]:
        return [scorer.spec for scorer in self.scorers]

    @property
    def cheap(self) -> bool:
        """Only in-process rule graders: scoring costs microseconds, nothing to overlap with generation."""
        return all(
            isinstance(s, BuiltinScorer) and not isinstance(s.grader, PooledGrader) for s in self.scorers
        )

    def begin_round(self, step: int, samples: int) -> None:
        """A generation round of `step` with `samples` samples starts: its calls count against the step's
        limits from here on (called on the event loop that scores it)."""
        self.limits.begin_round(step, samples)

    def start_deadline(self) -> None:
        """The round's last sample is back: the scoring left has reward.step_timeout_s."""
        self.limits.start_deadline()

    def end_round(self) -> None:
        self.limits.stop_deadline()

    async def score_group(self, samples: Sequence[RewardInput]) -> Scored:
        """Every function on one group's samples, concurrently; on_error=fail raises RewardError, and so
        does a limit of the step passed (`step_limits`): then this group's calls are cancelled."""
        work = asyncio.gather(*(scorer.score(samples) for scorer in self.scorers))
        tripped = self.limits.tripped
        try:
            if tripped is not None:
                await asyncio.wait({work, tripped}, return_when=asyncio.FIRST_COMPLETED)
                if tripped.done():
                    raise RewardError(tripped.result())
            raws = await work
        finally:
            if not work.done():
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await work
            elif not work.cancelled():
                work.exception()  # retrieved: a limit's error is the one raised
        outcomes: list[dict[str, Outcome]] = [{} for _ in samples]
        for scorer, results in zip(self.scorers, raws, strict=True):
            for per_sample, sample, raw in zip(outcomes, samples, results, strict=True):
                per_sample[scorer.spec.name] = settle(raw, scorer.spec, sample)
        return Scored(outcomes)

    def combine(self, outcomes: Sequence[dict[str, Outcome]]) -> Combined:
        """The step's rewards and metrics; RewardError when a function failed or timed out too often."""
        check_error_fraction(self.specs, outcomes, self.max_error_fraction)
        check_timeout_fraction(self.specs, outcomes, self.limits.max_timeout_fraction, self.limits.step)
        combined = combine(self.specs, outcomes)
        combined.metrics["reward_pool_restarts"] = self.take_restarts()
        return combined

    def take_restarts(self) -> int:
        """Worker-pool restarts (timeouts, dead workers) since the last call."""
        total = (self.pool.restarts if self.pool is not None else 0) + sum(
            getattr(getattr(s, "grader", None), "restarts", 0) or 0 for s in self.scorers
        )
        new, self._restarts_seen = total - self._restarts_seen, total
        return new

    async def aclose(self) -> None:
        for scorer in self.scorers:
            closing = getattr(scorer, "aclose", None)
            if closing is not None:
                await closing()

    def close(self) -> None:
        for scorer in self.scorers:
            scorer.close()
        if self.pool is not None:
            self.pool.close()
