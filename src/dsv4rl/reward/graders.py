"""Graders: response text (what the policy generated after the prompt) + ground truth -> reward.

Every grader returns `correct` or `incorrect` (defaults 1.0 / 0.0; DAPO trains with +1 / -1, set via
`reward.correct` / `reward.incorrect`).

- "arith": the tiny task. The stripped response must START with the answer as an integer (optional
  "-", then digits) equal, as a string, to the ground truth; whatever follows the integer is ignored
  (the tiny model may keep generating until <eos>) unless it makes a decimal ("7.5"). For answer "7":
  "7", " 7 ", "7=", "7 is it", "7." are right; "", "x7", "+7", "07", "72", "7.5", "-7" are wrong.
- "dapo": DAPO's rule grader (verl `math_dapo.compute_score`): look at the last 300 characters, take
  the text after the last "Answer:" (case-insensitive) on its line, Minerva-normalise it and the
  ground truth, compare the strings.
- "answer_line": the same rule over the whole response (not only its last 300 characters).
- "boxed": the same comparison on the content of the last balanced \\boxed{...}.
- "math_verify": Hugging Face math-verify, `verify(parse(gold), parse(response))`, run in worker
  processes with a per-response timeout (`timeout_s`) that works from any thread; a response that
  times out is graded incorrect and logged.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from dsv4rl.config.schema import GraderName, RewardConfig, choice
from dsv4rl.reward.normalize import last_answer_line, last_boxed, normalize_final_answer
from dsv4rl.reward.verify_pool import VerifyPool, verify_answer


@runtime_checkable
class Grader(Protocol):
    name: str

    def grade(self, response: str, ground_truth: str) -> float: ...

    def final_answer(self, response: str) -> str | None:
        """The normalised answer the response states, as this grader reads it (maj@n votes on it)."""
        ...


_LEADING_INT = re.compile(r"-?\d+(?!\.\d)(?!\d)")


@dataclass
class ArithGrader:
    correct: float = 1.0
    incorrect: float = 0.0
    name: str = field(default="arith", init=False)

    def grade(self, response: str, ground_truth: str) -> float:
        ok = self.final_answer(response) == ground_truth.strip()
        return self.correct if ok else self.incorrect

    def final_answer(self, response: str) -> str | None:
        match = _LEADING_INT.match(response.strip())
        return match.group(0) if match is not None else None


@dataclass
class DapoGrader:
    correct: float = 1.0
    incorrect: float = 0.0
    tail_chars: int = 300  # DAPO only reads the end of the response
    name: str = field(default="dapo", init=False)

    def extract(self, response: str) -> str | None:
        return last_answer_line(response[-self.tail_chars :] if self.tail_chars > 0 else response)

    def grade(self, response: str, ground_truth: str) -> float:
        answer = self.final_answer(response)
        ok = answer is not None and answer == normalize_final_answer(ground_truth)
        return self.correct if ok else self.incorrect

    def final_answer(self, response: str) -> str | None:
        answer = self.extract(response)
        return normalize_final_answer(answer) if answer is not None else None


@dataclass
class AnswerLineGrader(DapoGrader):
    """DAPO's "Answer:" rule over the whole response, for eval sets whose prompts ask for that line."""

    tail_chars: int = 0
    name: str = field(default="answer_line", init=False)


@dataclass
class BoxedGrader:
    correct: float = 1.0
    incorrect: float = 0.0
    name: str = field(default="boxed", init=False)

    def grade(self, response: str, ground_truth: str) -> float:
        answer = self.final_answer(response)
        ok = answer is not None and answer == normalize_final_answer(ground_truth)
        return self.correct if ok else self.incorrect

    def final_answer(self, response: str) -> str | None:
        answer = last_boxed(response)
        return normalize_final_answer(answer) if answer is not None else None


class MathVerifyGrader:
    """math-verify in `num_workers` worker processes (started on first use); `close()` stops them."""

    name = "math_verify"

    def __init__(
        self, correct: float = 1.0, incorrect: float = 0.0, timeout_s: float = 5.0, num_workers: int = 1
    ):
        self.correct, self.incorrect = correct, incorrect
        self.timeout_s, self.num_workers = timeout_s, num_workers
        self._pool = VerifyPool(num_workers=num_workers, timeout_s=timeout_s)

    def grade(self, response: str, ground_truth: str) -> float:
        return self.grade_many([response], [ground_truth])[0]

    def grade_many(self, responses: Sequence[str], ground_truths: Sequence[str]) -> list[float]:
        results = self._pool.map(verify_answer, list(zip(responses, ground_truths, strict=True)))
        return [self.correct if r is True else self.incorrect for r in results]

    def final_answer(self, response: str) -> str | None:
        """math-verify reads the last \\boxed{} (else the last "Answer:" line); votes use its normal form."""
        answer = last_boxed(response)
        if answer is None:
            answer = last_answer_line(response)
        return normalize_final_answer(answer) if answer is not None else None

    @property
    def restarts(self) -> int:
        """How many times the worker pool was killed (timeouts, dead workers)."""
        return self._pool.restarts

    def close(self) -> None:
        self._pool.close()

    def __getstate__(self) -> dict:  # picklable: the copy starts its own workers
        return {"correct": self.correct, "incorrect": self.incorrect, "timeout_s": self.timeout_s,
                "num_workers": self.num_workers}  # fmt: skip

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)


GRADERS: dict[GraderName, type] = {
    GraderName.arith: ArithGrader,
    GraderName.dapo: DapoGrader,
    GraderName.answer_line: AnswerLineGrader,
    GraderName.boxed: BoxedGrader,
    GraderName.math_verify: MathVerifyGrader,
}
_OPTIONS = {
    GraderName.arith: ("correct", "incorrect"),
    GraderName.dapo: ("correct", "incorrect", "tail_chars"),
    GraderName.answer_line: ("correct", "incorrect"),
    GraderName.boxed: ("correct", "incorrect"),
    GraderName.math_verify: ("correct", "incorrect", "timeout_s", "num_workers"),
}


def get_grader(name: GraderName | str, *, reward: RewardConfig | None = None, **kwargs) -> Grader:
    """A grader by name; unknown names or options raise ValueError listing what is accepted.

    `reward` (a recipe's reward section) supplies correct/incorrect (and timeout_s for math_verify);
    explicit keyword arguments override it.
    """
    name = choice(GraderName, name, "grader")
    unknown = sorted(set(kwargs) - set(_OPTIONS[name]))
    if unknown:
        raise ValueError(f"grader {name!r} does not take {unknown}; it accepts {list(_OPTIONS[name])}")
    if reward is not None:
        defaults = {"correct": reward.correct, "incorrect": reward.incorrect}
        if name == GraderName.math_verify:
            defaults["timeout_s"] = reward.timeout_s
        kwargs = {**defaults, **kwargs}
    return GRADERS[name](**kwargs)


def grader_from_config(cfg: RewardConfig, **overrides) -> Grader:
    """The grader a recipe's `reward` section asks for (timeout_s only applies to math_verify)."""
    return get_grader(cfg.grader, reward=cfg, **overrides)


def grade_batch(grader: Grader, responses: Sequence[str], answers: Sequence[str]) -> list[float]:
    """Rewards for many responses; uses the grader's batched path (one pool round) when it has one."""
    if len(responses) != len(answers):
        raise ValueError(f"grade_batch: {len(responses)} responses but {len(answers)} answers")
    grade_many = getattr(grader, "grade_many", None)
    if grade_many is not None:
        return list(grade_many(responses, answers))
    return [float(grader.grade(r, a)) for r, a in zip(responses, answers, strict=True)]


__all__ = [
    "GRADERS",
    "AnswerLineGrader",
    "ArithGrader",
    "BoxedGrader",
    "DapoGrader",
    "Grader",
    "MathVerifyGrader",
    "get_grader",
    "grade_batch",
    "grader_from_config",
]
