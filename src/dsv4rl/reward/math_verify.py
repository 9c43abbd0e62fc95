"""The math_verify grader (`builtin:math_verify`): Hugging Face math-verify, always in worker processes.

math-verify's own timeout uses SIGALRM, which only works on the main thread of the main process, so it is
disabled here (`parsing_timeout=None`, `timeout_seconds=None`) and replaced by the worker pool's
(`graders.PooledGrader`: the worker's alarm at `timeout_s`, a kill past it). The pool's workers load this
module as the `builtin:math_verify` target before they say ready, so no deadline pays for sympy's import.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import math_verify

from dsv4rl.reward.graders import PooledGrader, normalized_answer
from dsv4rl.reward.normalize import last_answer_line, last_boxed

logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout is disabled" notices

MATH_VERIFY_TAIL_CHARS = 4000


def _gold_text(ground_truth: str) -> str:
    """math-verify extracts LaTeX only from delimited text: wrap a bare answer ("\\frac{1}{2}") in $...$."""
    return ground_truth if ("$" in ground_truth or "\\boxed" in ground_truth) else f"${ground_truth}$"


def verify_answer(response: str, ground_truth: str) -> bool:
    """math-verify: `verify(parse(gold), parse(response))`, gold first; math-verify's timeouts off.

    Nothing is caught here: math-verify already turns an input it cannot parse or compare into "no
    match" (`raise_on_error=False`), so what escapes is a real failure (an API change, a missing
    dependency) that the pool reports as `CallFailed` rather than as a wrong answer.
    """
    gold = math_verify.parse(_gold_text(ground_truth), parsing_timeout=None)
    pred = math_verify.parse(response, parsing_timeout=None)
    if not gold or not pred:
        return False
    return bool(math_verify.verify(gold, pred, timeout_seconds=None))


@dataclass
class MathVerifyRule:
    """What a math_verify worker runs for one response (`MathVerifyGrader` is this rule in its pool)."""

    correct: float = 1.0
    incorrect: float = 0.0
    tail_chars: int = MATH_VERIFY_TAIL_CHARS  # what math-verify reads of a response (0: all of it)
    name: str = field(default="math_verify", init=False)

    def tail(self, response: str) -> str:
        return response[-self.tail_chars :] if self.tail_chars > 0 else response

    def grade(self, response: str, ground_truth: str) -> float:
        return self.correct if verify_answer(self.tail(response), ground_truth) else self.incorrect

    def final_answer(self, response: str) -> str | None:
        """math-verify reads the last \\boxed{} (else the last "Answer:" line); votes use its normal form."""
        text = self.tail(response)
        answer = last_boxed(text)
        return normalized_answer(answer if answer is not None else last_answer_line(text))


class MathVerifyGrader(PooledGrader):
    """math-verify in `num_workers` worker processes (started on first use); `close()` stops them."""

    def __init__(
        self,
        correct: float = 1.0,
        incorrect: float = 0.0,
        timeout_s: float = 5.0,
        num_workers: int = 1,
        tail_chars: int = MATH_VERIFY_TAIL_CHARS,
    ):
        rule = MathVerifyRule(correct, incorrect, tail_chars)
        super().__init__(rule, timeout_s=timeout_s, num_workers=num_workers)
