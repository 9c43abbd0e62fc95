"""Graders for the pool tests, in a module of their own: a pool worker imports the module of what it runs
when it first unpickles it, and a test module importing torch would spend the call's deadline on that."""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field


def blocked_sleep(seconds: float) -> str:
    """Ignores the worker's alarm (signal blocked), like a long C loop would: only a kill stops it."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(seconds)
    return "finished"


def echo(x):
    return x


@dataclass
class SlowRule:
    """A grader whose call on "slow" takes a minute: sleeping (the worker's alarm stops it) or with
    SIGALRM blocked, like a long C call (only killing the worker stops it)."""

    correct: float = 1.0
    incorrect: float = -1.0
    blocked: bool = False
    name: str = field(default="slow", init=False)

    def grade(self, response: str, ground_truth: str) -> float:
        if response == "slow":
            if self.blocked:
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
            time.sleep(60)
        return self.correct if response == ground_truth else self.incorrect

    def final_answer(self, response: str) -> str | None:
        return response


@dataclass
class RaisingRule:
    """Raises `kind` on responses that start with "bad" (all of them with `always`)."""

    kind: type[Exception] = ValueError
    message: str = "cannot grade this"
    always: bool = False
    correct: float = 1.0
    incorrect: float = 0.0
    name: str = field(default="raising", init=False)

    def grade(self, response: str, ground_truth: str) -> float:
        if self.always or response.startswith("bad"):
            raise self.kind(self.message)
        return self.correct if response == ground_truth else self.incorrect

    def final_answer(self, response: str) -> str | None:
        return response
