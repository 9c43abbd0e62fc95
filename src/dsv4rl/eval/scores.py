"""Eval scores from graded samples: unbiased pass@k, avg@n, maj@n, truncation and length (pure functions).

pass@k is Chen et al. (2021)'s unbiased estimator, 1 - C(n-c, k) / C(n, k), averaged over problems
(`dsv4rl.algo.metrics.pass_at_k`); with k = 1 it is the mean accuracy. maj@n grades the answer most of a
problem's n samples agree on (majority vote over their normalised final answers, the first one seen
winning a tie; a problem where no sample states an answer counts as wrong), as peers report it next to
pass@k.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from dsv4rl.algo.metrics import pass_at_k

__all__ = ["ProblemResult", "majority_correct", "pass_ks", "score_problems"]


@dataclass
class ProblemResult:
    """One problem's samples after grading. `lengths` (response tokens) and `truncated` are None when
    unknown (saved responses carry neither)."""

    id: str
    answer: str
    correct: list[bool]
    final_answers: list[str | None]  # each sample's normalised final answer, None when it states none
    lengths: list[int] | None = None
    truncated: list[bool] | None = None
    responses: list[str] = field(default_factory=list, repr=False)
    rewards: list[float] | None = None  # each sample's reward total when the recipe's reward scored it

    @property
    def samples(self) -> int:
        return len(self.correct)


def pass_ks(n: int) -> list[int]:
    """The k of a report: 1, 2, 4, ... up to n, and n itself."""
    if n < 1:
        raise ValueError(f"pass@k needs at least one sample per problem, got n={n}")
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    return ks if ks[-1] == n else [*ks, n]


def majority_correct(final_answers: Sequence[str | None], correct: Sequence[bool]) -> bool:
    """Whether the majority answer is right (graded as its first sample was)."""
    stated = [a for a in final_answers if a is not None]
    if not stated:
        return False
    winner = Counter(stated).most_common(1)[0][0]  # Counter keeps first-seen order among ties
    return bool(correct[list(final_answers).index(winner)])


def score_problems(results: Sequence[ProblemResult]) -> dict[str, float | int | None]:
    """The report's headline numbers. Every problem must have the same number of samples n."""
    if not results:
        raise ValueError("no graded problems to score")
    counts = {r.samples for r in results}
    if len(counts) != 1:
        raise ValueError(
            f"every problem needs the same number of samples to score pass@k, got {sorted(counts)}"
        )
    n = counts.pop()
    scores: dict[str, float | int | None] = {}
    for k in pass_ks(n):
        scores[f"pass@{k}"] = sum(pass_at_k(n, sum(r.correct), k) for r in results) / len(results)
    # avg@n: the mean accuracy; scored by the recipe's reward, the mean reward total
    per_sample = [r.rewards if r.rewards is not None else r.correct for r in results]
    scores[f"avg@{n}"] = sum(sum(values) / n for values in per_sample) / len(results)
    scores[f"maj@{n}"] = sum(majority_correct(r.final_answers, r.correct) for r in results) / len(results)
    truncated = [t for r in results if r.truncated is not None for t in r.truncated]
    lengths = [n_tokens for r in results if r.lengths is not None for n_tokens in r.lengths]
    scores["truncation_ratio"] = sum(truncated) / len(truncated) if truncated else None
    scores["response_len_mean"] = sum(lengths) / len(lengths) if lengths else None
    scores["problems"] = len(results)
    scores["samples_per_problem"] = n
    return scores


def problem_row(result: ProblemResult) -> dict[str, object]:
    """One line of the per-problem table."""
    n, c = result.samples, sum(result.correct)
    stated = Counter(a for a in result.final_answers if a is not None).most_common(1)
    return {
        "id": result.id,
        "answer": result.answer,
        "samples": n,
        "correct": c,
        "pass@1": c / n,
        f"pass@{n}": pass_at_k(n, c, n),
        "majority_answer": stated[0][0] if stated else None,
        "majority_correct": majority_correct(result.final_answers, result.correct),
        "truncated": sum(result.truncated) if result.truncated is not None else None,
        **({"reward_mean": sum(result.rewards) / n} if result.rewards is not None else {}),
    }
