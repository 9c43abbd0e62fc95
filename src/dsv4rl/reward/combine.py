"""The reward maths of a step: each function's verdicts -> one reward per sample, and what metrics.jsonl
gets. Pure functions.

- A call that timed out, raised or returned something unusable counts under its function's `on_error`
  (`settle`): `fail` stops the run, `zero` scores 0 (a builtin grader: its `incorrect`), `exclude` gives
  no score, as a returned None does.
- A sample's reward is the weighted sum of the scores it got; a function with weight 0 is only logged. A
  sample no weighted function scored has no reward: it is left out of the loss (and counted).
- More of a step's calls of one function raised than `max_error_fraction` allows: the run stops with the
  first failure's traceback (never train on zeros); more timed out than `max_timeout_fraction` allows: the
  run stops naming the function and its timeout (`step_limits` stops it as soon as that many have).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dsv4rl.config.choices import RewardOnError
from dsv4rl.reward.inputs import RewardInput
from dsv4rl.reward.results import (
    TIMED_OUT,
    BadResult,
    CallFailed,
    FnSpec,
    Outcome,
    RewardError,
    read_result,
    user_frame,
)
from dsv4rl.reward.step_limits import timeouts_message

FIX = "fix the function, or set its on_error to zero or exclude (docs/tasks.md)"


def _where(spec: FnSpec, sample: RewardInput) -> str:
    return f"reward function {spec.name!r} ({spec.target}) on sample {sample.index} of step {sample.step}"


def settle(raw: Any, spec: FnSpec, sample: RewardInput) -> Outcome:
    """One call's result as an `Outcome` under `spec.on_error`; raises RewardError for on_error=fail."""
    traceback = ""
    if raw is TIMED_OUT:
        status, error = "timeout", f"no result within timeout_s={spec.timeout_s:g}"
    elif isinstance(raw, CallFailed):
        where = user_frame(raw.traceback)
        status, traceback = "error", raw.traceback
        error = f"{raw.error_type}: {raw.message}" + (f" (at {where})" if where else "")
    else:
        try:
            score, extras = read_result(raw)
        except BadResult as bad:
            status, error = "error", f"BadResult: {bad}"
        else:
            return Outcome(score, extras, "ok" if score is not None else "none")
    if spec.on_error == RewardOnError.fail:
        detail = f"\n{traceback}" if traceback else ""
        raise RewardError(f"{_where(spec, sample)}: {error} (on_error=fail stops the run); {FIX}{detail}")
    score = spec.zero if spec.on_error == RewardOnError.zero else None
    return Outcome(score, {}, status, error, traceback)


@dataclass
class Combined:
    """A step's rewards: the weighted sum per sample (0.0 where excluded), which samples have one, and the
    metrics of every function."""

    totals: list[float]
    scored: list[bool]
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def excluded(self) -> int:
        return sum(not s for s in self.scored)


def combine(specs: Sequence[FnSpec], outcomes: Sequence[dict[str, Outcome]]) -> Combined:
    """The weighted sum of each sample's scores, and the per-function metrics (`function_metrics`)."""
    totals, scored = [], []
    for per_sample in outcomes:
        total, counted = 0.0, False
        for spec in specs:
            score = per_sample[spec.name].score
            if spec.weight != 0 and score is not None:
                total += spec.weight * score
                counted = True
        totals.append(total if counted else 0.0)
        scored.append(counted)
    combined = Combined(totals, scored)
    combined.metrics = {**function_metrics(specs, outcomes), "reward_excluded": combined.excluded}
    return combined


def function_metrics(specs: Sequence[FnSpec], outcomes: Sequence[dict[str, Outcome]]) -> dict[str, float]:
    """reward/<name>/score (the mean of the scores its samples got, on_error=zero's included) and
    reward/<name>/<key> of dict results (the mean over the samples that have the key);
    reward/<name>/{scored,none,timeouts,errors}: counts, `scored` only the calls that returned a score."""
    metrics: dict[str, float] = {}
    for spec in specs:
        mine = [per_sample[spec.name] for per_sample in outcomes]
        prefix = f"reward/{spec.name}/"
        scores = [o.score for o in mine if o.score is not None]
        if scores:
            metrics[prefix + "score"] = sum(scores) / len(scores)
        sums: dict[str, list[float]] = {}
        for outcome in mine:
            for key, value in outcome.extras.items():
                sums.setdefault(key, []).append(value)
        metrics.update({prefix + key: sum(values) / len(values) for key, values in sums.items()})
        metrics[prefix + "scored"] = sum(o.status == "ok" for o in mine)
        metrics[prefix + "none"] = sum(o.status == "none" for o in mine)
        metrics[prefix + "timeouts"] = sum(o.status == "timeout" for o in mine)
        metrics[prefix + "errors"] = sum(o.status == "error" for o in mine)
    return metrics


def check_error_fraction(
    specs: Sequence[FnSpec], outcomes: Sequence[dict[str, Outcome]], max_fraction: float
) -> None:
    """RewardError when more than `max_fraction` of one function's calls this step raised (or returned
    something unusable), naming the first failure and its traceback."""
    n = len(outcomes)
    for spec in specs:
        failed = [per_sample[spec.name] for per_sample in outcomes if per_sample[spec.name].status == "error"]
        if n and len(failed) > max_fraction * n:
            first = failed[0]
            detail = f"\nfirst traceback:\n{first.traceback}" if first.traceback else ""
            raise RewardError(
                f"reward function {spec.name!r} ({spec.target}): {len(failed)} of {n} calls this step failed "
                f"({len(failed) / n:.0%}, more than reward.max_error_fraction={max_fraction:g}); first: "
                f"{first.error}; {FIX.split(', or')[0]} (a run must not train on errors){detail}"
            )


def check_timeout_fraction(
    specs: Sequence[FnSpec],
    outcomes: Sequence[dict[str, Outcome]],
    max_fraction: float,
    step: int | None = None,
) -> None:
    """RewardError when more than `max_fraction` of one function's calls this step timed out, naming the
    function, its timeout and the fix."""
    n = len(outcomes)
    for spec in specs:
        timed_out = sum(per_sample[spec.name].status == "timeout" for per_sample in outcomes)
        if n and timed_out > max_fraction * n:
            raise RewardError(timeouts_message(spec, timed_out, n, max_fraction, step))


def grader_counts(metrics: dict[str, float], specs: Sequence[FnSpec]) -> dict[str, float]:
    """The step's calls that timed out or failed, all functions together, and the worker-pool restarts,
    under the names metrics.jsonl always had (grader_timeouts, grader_errors, grader_restarts)."""
    return {
        "grader_timeouts": sum(metrics.get(f"reward/{s.name}/timeouts", 0) for s in specs),
        "grader_errors": sum(metrics.get(f"reward/{s.name}/errors", 0) for s in specs),
        "grader_restarts": metrics.get("reward_pool_restarts", 0),
    }
