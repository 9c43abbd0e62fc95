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
  times out is graded incorrect and logged. It reads the response's last `tail_chars` (4,000, about
  1,000 tokens; the answer is at the end): math-verify's parsing is superlinear in the length of the
  expressions it finds (a 16 k-character sum takes seconds), partly in C calls no timer interrupts.

The rule graders run in linear time and read at most `MAX_ANSWER_CHARS` of answer (normalize.py), so
they grade a 100 k-character response in milliseconds and run in the calling process during training.
math-verify (sympy) has no such bound and always runs in its pool. Eval and training's periodic eval
run every grader, the answers maj@n votes on included, in a pool (`get_grader(..., pooled=True)`).

`grade_responses` grades a batch: a call that times out is graded incorrect; a call that raises is
graded incorrect, counted by exception type and logged, and when more than `max_error_fraction` of a
batch raised it stops with a `GraderError` naming the exception (a math-verify API change must not
train on zeros). The counts (`Graded.counts`) go into metrics.jsonl and eval reports.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from dsv4rl.config.choices import GraderName, choice
from dsv4rl.config.schema import RewardConfig
from dsv4rl.reward.fn_pool import AsyncProcessPool
from dsv4rl.reward.normalize import MAX_ANSWER_CHARS, last_answer_line, last_boxed, normalize_final_answer
from dsv4rl.reward.results import TIMED_OUT, CallFailed, call_failed
from dsv4rl.targets import BUILTIN, load, parse

logger = logging.getLogger(__name__)

DEFAULT_MAX_ERROR_FRACTION = RewardConfig.max_error_fraction


@runtime_checkable
class Grader(Protocol):
    name: str

    def grade(self, response: str, ground_truth: str) -> float: ...

    def final_answer(self, response: str) -> str | None:
        """The normalised answer the response states, as this grader reads it (maj@n votes on it)."""
        ...


def normalized_answer(answer: str | None) -> str | None:
    """An extracted answer, normalised; None for none, or for one longer than MAX_ANSWER_CHARS."""
    return normalize_final_answer(answer) if answer is not None and len(answer) <= MAX_ANSWER_CHARS else None


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
        return normalized_answer(self.extract(response))


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
        return normalized_answer(last_boxed(response))


def _grade_call(rule: Grader, response: str, truth: str, reward: bool, answer: bool) -> tuple:
    """One response, in a pool worker: (reward or None, final answer or None)."""
    return (
        rule.grade(response, truth) if reward else None,
        rule.final_answer(response) if answer else None,
    )


@dataclass
class PoolRound:
    """One `PooledGrader.run`: per call a value, TIMED_OUT or CallFailed; and the workers restarted."""

    results: list[Any]
    restarts: int = 0


GRACE_S = 2.0  # past its timeout, how long a call that its worker's alarm did not stop may take to answer


class PooledGrader:
    """A grader whose calls run in `num_workers` worker processes (`AsyncProcessPool`, started on first use),
    each call under `timeout_s`; `close()` stops them. Eval wraps every grader in one; math_verify is one
    always. Usable from any thread: the pool lives on an event loop of its own thread, and rounds are
    serialised (each round's restarts are its own).

    A call past `timeout_s` is stopped by its worker's alarm (the worker goes on); one stuck where no signal
    gets through (a long C loop) has its worker killed at `timeout_s + GRACE_S` and a fresh one started."""

    def __init__(self, rule: Grader, timeout_s: float = 5.0, num_workers: int = 1):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 (reward.timeout_s), got {timeout_s}")
        self.rule, self.timeout_s, self.num_workers = rule, timeout_s, num_workers
        # math-verify's workers load its builtin target (its sympy import) before they say ready
        preload = [parse(BUILTIN + rule.name, (), GRADERS)] if rule.name == GraderName.math_verify else []
        self._pool = AsyncProcessPool(num_workers, preload, label=f"grader {rule.name}")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return self.rule.name

    @property
    def correct(self) -> float:
        return self.rule.correct

    @property
    def incorrect(self) -> float:
        return self.rule.incorrect

    def _round(self, calls: list[tuple]) -> PoolRound:
        """`_grade_call(*call)` for each call in the pool, from any thread (one round at a time)."""

        async def gather() -> list[Any]:
            pending = [self._pool.call(_grade_call, c, self.timeout_s, grace_s=GRACE_S) for c in calls]
            return list(await asyncio.gather(*pending))

        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(
                    target=self._loop.run_forever, name=f"dsv4rl-{self.name}-pool", daemon=True
                )
                self._thread.start()
            before = self._pool.restarts
            results = asyncio.run_coroutine_threadsafe(gather(), self._loop).result()
            return PoolRound(results, self._pool.restarts - before)

    def run(self, responses: Sequence[str], truths: Sequence[str], answers: bool) -> PoolRound:
        """One pool round: (reward, final answer or None) per response, or TIMED_OUT / CallFailed."""
        return self._round([(self.rule, r, t, True, answers) for r, t in zip(responses, truths, strict=True)])

    def grade(self, response: str, ground_truth: str) -> float:
        return grade_responses(self, [response], [ground_truth]).rewards[0]

    def grade_many(self, responses: Sequence[str], ground_truths: Sequence[str]) -> list[float]:
        return grade_responses(self, responses, ground_truths).rewards

    def final_answer(self, response: str) -> str | None:
        (outcome,) = self._round([(self.rule, response, "", False, True)]).results
        if isinstance(outcome, CallFailed):
            raise GraderError(
                f"grader {self.name}: final_answer raised {outcome.error_type}: {outcome.message}"
            )
        return None if outcome is TIMED_OUT else outcome[1]

    @property
    def restarts(self) -> int:
        """How many times a worker was killed and replaced (a call stuck past its alarm, a dead worker)."""
        return self._pool.restarts

    def close(self) -> None:
        with self._lock:
            loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
            if loop is None:
                return

            async def close_pool() -> None:
                self._pool.close()

            asyncio.run_coroutine_threadsafe(close_pool(), loop).result()
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
            if not thread.is_alive():
                loop.close()

    def __getstate__(self) -> dict:  # picklable: the copy starts its own workers
        return {"rule": self.rule, "timeout_s": self.timeout_s, "num_workers": self.num_workers}

    def __setstate__(self, state: dict) -> None:
        PooledGrader.__init__(self, **state)


class GraderError(RuntimeError):
    """More of a batch's grader calls raised than `reward.max_error_fraction` allows."""


@dataclass
class Graded:
    """A graded batch: rewards (incorrect where a call timed out or raised), the final answers when
    asked for (None where none), and what went wrong."""

    rewards: list[float]
    answers: list[str | None] | None = None
    timeouts: int = 0
    errors: int = 0
    error_types: dict[str, int] = field(default_factory=dict)
    restarts: int = 0

    def counts(self) -> dict[str, int]:
        """The numbers metrics.jsonl gets (summed over a step's grading rounds)."""
        return {
            "grader_timeouts": self.timeouts,
            "grader_errors": self.errors,
            "grader_restarts": self.restarts,
        }

    def summary(self) -> dict[str, Any]:
        """What an eval report says about its grading."""
        return {"timeouts": self.timeouts, "errors": self.errors, "error_types": dict(self.error_types),
                "restarts": self.restarts}  # fmt: skip


def _in_process(grader: Grader, response: str, truth: str, answers: bool) -> tuple[Any, BaseException | None]:
    try:
        return _grade_call(grader, response, truth, True, answers), None
    except Exception as exc:
        return call_failed(exc), exc


def grade_responses(
    grader: Grader,
    responses: Sequence[str | None],
    truths: Sequence[str],
    *,
    answers: bool = False,
    max_error_fraction: float = DEFAULT_MAX_ERROR_FRACTION,
) -> Graded:
    """Grade a batch (a pooled grader: one pool round; else in this process) -> `Graded`.

    A response of None has no answer (a thinking block that never closed): graded incorrect, with no
    grader call. Raises GraderError when more than `max_error_fraction` of the calls raised."""
    if len(responses) != len(truths):
        raise ValueError(f"grade_batch: {len(responses)} responses but {len(truths)} answers")
    if any(response is None for response in responses):
        present = [i for i, response in enumerate(responses) if response is not None]
        graded = (
            grade_responses(
                grader,
                [responses[i] for i in present],
                [truths[i] for i in present],
                answers=answers,
                max_error_fraction=max_error_fraction,
            )
            if present
            else Graded(rewards=[])
        )
        rewards = [float(getattr(grader, "incorrect", 0.0))] * len(responses)
        stated: list[str | None] | None = [None] * len(responses) if answers else None
        for at, i in enumerate(present):
            rewards[i] = graded.rewards[at]
            if stated is not None and graded.answers is not None:
                stated[i] = graded.answers[at]
        graded.rewards, graded.answers = rewards, stated
        return graded
    first_exception: BaseException | None = None
    if isinstance(grader, PooledGrader):
        pool_round = grader.run(responses, truths, answers)
        outcomes, restarts = pool_round.results, pool_round.restarts
    else:
        outcomes, restarts = [], 0
        for response, truth in zip(responses, truths, strict=True):
            outcome, exc = _in_process(grader, response, truth, answers)
            outcomes.append(outcome)
            first_exception = first_exception or exc
    incorrect = float(getattr(grader, "incorrect", 0.0))
    graded = Graded(rewards=[], answers=[] if answers else None, restarts=restarts)
    failures: list[CallFailed] = []
    for outcome in outcomes:
        if outcome is TIMED_OUT or isinstance(outcome, CallFailed):
            reward, answer = incorrect, None
            if outcome is TIMED_OUT:
                graded.timeouts += 1
            else:
                failures.append(outcome)
        else:
            reward, answer = outcome
        graded.rewards.append(float(reward))
        if graded.answers is not None:
            graded.answers.append(answer)
    if failures:
        graded.errors = len(failures)
        graded.error_types = dict(Counter(f.error_type for f in failures))
        _check_failures(grader.name, failures, len(outcomes), max_error_fraction, first_exception)
    return graded


def _check_failures(
    name: str, failures: list[CallFailed], n: int, max_fraction: float, exc: BaseException | None
) -> None:
    by_type = Counter(f.error_type for f in failures)
    first = failures[0]
    logger.warning(
        "grader %s: %d of %d calls raised (%s), graded incorrect; first: %s: %s",
        name, len(failures), n, ", ".join(f"{k} x{v}" for k, v in by_type.items()), first.error_type,
        first.message,
    )  # fmt: skip
    if len(failures) > max_fraction * n:
        detail = f"\n{first.traceback}" if first.traceback and exc is None else ""
        raise GraderError(
            f"grader {name}: {len(failures)} of {n} calls raised ({len(failures) / n:.0%}, more than "
            f"reward.max_error_fraction={max_fraction}): {first.error_type}: {first.message}. Their rewards "
            f"would be wrong, so the run stops (a grader or math-verify version problem?){detail}"
        ) from exc


def grade_batch(
    grader: Grader,
    responses: Sequence[str],
    answers: Sequence[str],
    *,
    max_error_fraction: float = DEFAULT_MAX_ERROR_FRACTION,
) -> list[float]:
    """Rewards for many responses (`grade_responses`, rewards only)."""
    return grade_responses(grader, responses, answers, max_error_fraction=max_error_fraction).rewards


# The builtin graders as targets (`builtin:<grader>`, dsv4rl.targets); math_verify is loaded only when used
# (its module imports math-verify, and so sympy).
GRADERS: dict[str, str] = {
    GraderName.arith: f"{__name__}:ArithGrader",
    GraderName.dapo: f"{__name__}:DapoGrader",
    GraderName.answer_line: f"{__name__}:AnswerLineGrader",
    GraderName.boxed: f"{__name__}:BoxedGrader",
    GraderName.math_verify: "dsv4rl.reward.math_verify:MathVerifyGrader",
}
_OPTIONS = {
    GraderName.arith: ("correct", "incorrect"),
    GraderName.dapo: ("correct", "incorrect", "tail_chars"),
    GraderName.answer_line: ("correct", "incorrect"),
    GraderName.boxed: ("correct", "incorrect"),
    GraderName.math_verify: ("correct", "incorrect", "timeout_s", "num_workers", "tail_chars"),
}


def grader_options(name: GraderName | str) -> tuple[str, ...]:
    """The options a grader takes (`get_grader`'s keyword arguments; a `builtin:` reward's kwargs)."""
    return _OPTIONS[choice(GraderName, name, "grader")]


def get_grader(
    name: GraderName | str, *, reward: RewardConfig | None = None, pooled: bool = False, **kwargs
) -> Grader:
    """A grader by name; unknown names or options raise ValueError listing what is accepted.

    `reward` (a recipe's reward section) supplies correct/incorrect, and timeout_s and num_workers for a
    pool; explicit keyword arguments override it. `pooled=True` runs any grader in a worker pool with
    per-call timeouts (eval does); math_verify always runs in one.
    """
    name = choice(GraderName, name, "grader")
    unknown = sorted(set(kwargs) - set(_OPTIONS[name]))
    if unknown:
        raise ValueError(f"grader {name!r} does not take {unknown}; it accepts {list(_OPTIONS[name])}")
    reward = reward if reward is not None else (RewardConfig() if pooled else None)
    if reward is not None:
        defaults = {"correct": reward.correct, "incorrect": reward.incorrect}
        if name == GraderName.math_verify:
            defaults |= {"timeout_s": reward.timeout_s, "num_workers": reward.num_workers}
        kwargs = {**defaults, **kwargs}
    grader = load(BUILTIN + name, (), GRADERS, role="grader", what="class", builtin_noun="grader")(**kwargs)
    if pooled and not isinstance(grader, PooledGrader):
        grader = PooledGrader(grader, timeout_s=reward.timeout_s, num_workers=reward.num_workers)
    return grader


def grader_from_config(cfg: RewardConfig, **overrides) -> Grader:
    """The grader a recipe's `reward` section asks for (timeout_s only applies to math_verify)."""
    return get_grader(cfg.grader, reward=cfg, **overrides)


__all__ = [
    "DEFAULT_MAX_ERROR_FRACTION",
    "GRADERS",
    "AnswerLineGrader",
    "ArithGrader",
    "BoxedGrader",
    "DapoGrader",
    "Graded",
    "Grader",
    "GraderError",
    "PooledGrader",
    "get_grader",
    "grader_options",
    "grade_batch",
    "grade_responses",
    "grader_from_config",
]
