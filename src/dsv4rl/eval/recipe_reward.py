"""An eval scored by the recipe's own reward (`eval.scored_by: recipe`, what `dsv4rl eval` does when no
eval set is named): every response goes through the recipe's `RewardSet` (reward.fns, or the
`reward.grader` short form, remote, judge), built and isolated as training builds it, so a user's
function runs in the same worker pool with the same `RewardInput` it gets in training.

A response passes (counts as correct for pass@k and maj@n) when its weighted reward total reaches
`eval.pass_reward`; null is `full_weight`: the weight sum of the functions with a positive weight, every
one of them at its full score of 1.0 (one correctness function of weight 1: reward 1.0). avg@n is then
the mean reward total, as verl's validation reports its mean test score. maj@n votes on the stripped
answer text (the part after a closed thinking block; none when it never closed).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from dsv4rl.aio import run_on
from dsv4rl.config.choices import ChatFormat
from dsv4rl.config.compose import reward_base_dirs
from dsv4rl.config.schema import Config, RewardConfig
from dsv4rl.data.chat_response import ResponseParts
from dsv4rl.data.problems import Problem
from dsv4rl.eval.scores import ProblemResult
from dsv4rl.reward.graders import Graded
from dsv4rl.reward.inputs import RewardInput
from dsv4rl.reward.results import Outcome
from dsv4rl.reward.rewarder import RewardSet, effective_fns
from dsv4rl.rollout.reward_inputs import reward_inputs
from dsv4rl.samples import Sample

__all__ = ["PASS_TOLERANCE", "RecipeReward", "describe_reward", "full_weight", "pass_threshold"]

PASS_TOLERANCE = 1e-9  # a total summed from float weights passes a threshold it equals


def _weighted(cfg: RewardConfig) -> list[tuple[str, float]]:
    """(name, weight) of every function of the recipe's reward, in order."""
    out = [(fn.name, fn.weight) for fn in effective_fns(cfg)]
    out += [(cfg.remote.name, cfg.remote.weight)] if cfg.remote.url else []
    return out + ([(cfg.judge.name, cfg.judge.weight)] if cfg.judge.base_url else [])


def full_weight(cfg: RewardConfig) -> float:
    """The total a response gets when every positively weighted function gives it 1.0."""
    return sum(weight for _, weight in _weighted(cfg) if weight > 0)


def pass_threshold(cfg: Config) -> float:
    """The reward total a response must reach to pass: `eval.pass_reward`, else `full_weight`."""
    given = cfg.eval.pass_reward if cfg.eval is not None else None
    return given if given is not None else full_weight(cfg.reward)


def describe_reward(cfg: RewardConfig) -> str:
    """The report's `grader` line: "reward.fns: correct (weight 1.0), short (0.5)"."""
    parts = [
        f"{name} (weight {weight:g})" if i == 0 else f"{name} ({weight:g})"
        for i, (name, weight) in enumerate(_weighted(cfg))
    ]
    return "reward.fns: " + ", ".join(parts)


def _saved_inputs(problem: Problem, texts: Sequence[str], answers: Sequence[str | None] | None) -> list:
    """A saved response's `RewardInput`: its text and the data row (no token ids: none were sampled)."""
    return [
        RewardInput(
            prompt=problem.prompt,
            response=text,
            answer=answers[i] if answers is not None else text,
            ground_truth=problem.answer,
            metadata=dict(problem.metadata),
            problem_id=problem.id,
        )
        for i, text in enumerate(texts)
    ]


def _summary(outcomes: Sequence[dict[str, Outcome]], totals: list[float], restarts: int) -> Graded:
    """The report's `grading`: the calls that timed out or raised, by exception type."""
    graded = Graded(rewards=totals, restarts=restarts)
    for per_sample in outcomes:
        for outcome in per_sample.values():
            if outcome.status == "timeout":
                graded.timeouts += 1
            elif outcome.status == "error":
                graded.errors += 1
                kind = (outcome.error or "error").split(":", 1)[0]
                graded.error_types[kind] = graded.error_types.get(kind, 0) + 1
    return graded


class RecipeReward:
    """The recipe's `RewardSet` as an eval's grader; its worker pool starts on the first eval and lives
    until `close` (a periodic eval keeps it for the run)."""

    def __init__(self, cfg: Config) -> None:
        self.rewards = RewardSet.from_config(cfg.reward, reward_base_dirs(cfg))
        self.threshold = pass_threshold(cfg)
        self.name = describe_reward(cfg.reward)
        self.chat = cfg.data.chat_format != ChatFormat.none
        self._loop: asyncio.AbstractEventLoop | None = None  # its own, for saved responses
        self._used: asyncio.AbstractEventLoop | None = None
        self._started = False

    def grade(
        self,
        problems: Sequence[Problem],
        responses: Sequence[Sequence[str]],
        event_loop: asyncio.AbstractEventLoop | None = None,
        samples: Sequence[Sequence[Sample]] | None = None,
        parts: Sequence[Sequence[ResponseParts]] | None = None,
        answer_parts: Sequence[Sequence[str | None]] | None = None,
        final_texts: Sequence[Sequence[str]] | None = None,
    ) -> tuple[list[ProblemResult], float, Graded, dict[str, float]]:
        """Score every response -> results, the seconds it took, the grading's failures, and the
        per-function means (`reward/<name>/score`, as training logs them). A function that failed more
        often than `reward.max_error_fraction` raises RewardError: a broken reward is never a low score."""
        groups: list[list[RewardInput]] = []
        first = 0
        for i, problem in enumerate(problems):
            if samples is not None:
                group = reward_inputs(
                    problem,
                    samples[i],
                    parts[i] if parts is not None else None,
                    0,
                    first,
                    self.chat,
                    final_texts[i] if final_texts is not None else (),
                )
            else:
                group = _saved_inputs(problem, responses[i], answer_parts[i] if answer_parts else None)
            groups.append(group)
            first += len(group)
        loop = event_loop
        if loop is None:
            loop = self._loop = self._loop or asyncio.new_event_loop()
        self._used = loop  # where the remote and judge clients live: closed there
        start = time.monotonic()
        scored = run_on(loop, self._score(groups, first))
        seconds = time.monotonic() - start
        outcomes = [per_sample for group in scored for per_sample in group]
        combined = self.rewards.combine(outcomes)
        restarts = int(combined.metrics.pop("reward_pool_restarts", 0))
        graded = _summary(outcomes, combined.totals, restarts)
        results, at = [], 0
        for i, (problem, group, texts) in enumerate(zip(problems, groups, responses, strict=True)):
            totals = combined.totals[at : at + len(group)]
            at += len(group)
            sampled = samples[i] if samples is not None else None
            results.append(
                ProblemResult(
                    id=problem.id,
                    answer=problem.answer,
                    correct=[t >= self.threshold - PASS_TOLERANCE for t in totals],
                    final_answers=[x.answer.strip() if x.answer is not None else None for x in group],
                    lengths=[len(s.response_ids) for s in sampled] if sampled is not None else None,
                    truncated=[s.truncated for s in sampled] if sampled is not None else None,
                    responses=list(texts),
                    rewards=list(totals),
                )
            )
        return results, seconds, graded, combined.metrics

    async def _score(self, groups: list[list[RewardInput]], total: int) -> list[list[dict[str, Outcome]]]:
        if not self._started:
            await self.rewards.start()
            self._started = True
        self.rewards.begin_round(0, total)
        self.rewards.start_deadline()  # every response is back: the scoring gets reward.step_timeout_s
        try:
            scored = await asyncio.gather(*(self.rewards.score_group(group) for group in groups))
        finally:
            self.rewards.end_round()
        return [s.outcomes for s in scored]

    def report_fields(self) -> dict[str, Any]:
        return {"grader": self.name, "scored_by": "recipe", "pass_reward": self.threshold}

    def close(self) -> None:
        """The worker pool and the HTTP clients (on the loop that scored, while it is open)."""
        used = self._used
        if used is not None and not used.is_closed() and not used.is_running():
            used.run_until_complete(self.rewards.aclose())
        if self._loop is not None:
            self._loop.close()
        self.rewards.close()
