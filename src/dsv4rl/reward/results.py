"""What a call into user or grader code gave (a value, `TIMED_OUT` or a `CallFailed`); what a reward function
returned, read as a score and named numbers; where a failed call raised.

A function returns a number (the score), a dict with `score` and any other numeric keys (each logged as
`reward/<name>/<key>`), or None (no score from this function for that sample). Anything else is the
function's error, reported with what it returned.
"""

from __future__ import annotations

import math
import re
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsv4rl.config.choices import RewardOnError


class _Sentinel:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


TIMED_OUT = _Sentinel("TIMED_OUT")  # result of a call that ran out of time


@dataclass(frozen=True)
class CallFailed:
    """Result of a call that raised (or whose worker died twice): the exception's type and message."""

    error_type: str  # "TypeError", "sympy.core.sympify.SympifyError", ...
    message: str
    traceback: str = ""  # the worker's traceback, for the log and the error that stops a run


def _type_name(exc: BaseException) -> str:
    kind = type(exc)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def call_failed(exc: BaseException) -> CallFailed:
    """`exc` as a call's result (its traceback kept for the message that stops a run)."""
    return CallFailed(_type_name(exc), str(exc), "".join(traceback.format_exception(exc)))


# metrics.jsonl keys of each function's counts: a dict result may not use these names
COUNT_KEYS = ("scored", "none", "timeouts", "errors")


@dataclass(frozen=True)
class FnSpec:
    """What the reward maths and the error policy need to know of a function."""

    name: str
    target: str  # as the recipe wrote it (messages)
    weight: float
    on_error: RewardOnError
    timeout_s: float
    group: bool = False
    zero: float = 0.0  # what on_error=zero gives (a builtin grader: its `incorrect`)


class RewardError(RuntimeError):
    """A reward function failed in a way that stops the run (on_error: fail, or more of a step's calls raised
    than reward.max_error_fraction allows); the message names the function, where it raised and the fix."""


class BadResult(ValueError):
    """A return value that is not a number, a dict with a numeric `score`, or None."""


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool):
        return float(value)
    try:
        number = float(value)  # int, float, numpy and torch scalars
    except (TypeError, ValueError):
        raise BadResult(f"{what} is {type(value).__name__} {value!r:.80}; return numbers") from None
    if not math.isfinite(number):
        raise BadResult(f"{what} is {number}; return a finite number, or None for no score")
    return number


def read_result(value: Any) -> tuple[float | None, dict[str, float]]:
    """(score or None, the other named numbers) of one returned value; BadResult when it is neither a
    number, a dict with `score`, nor None."""
    if value is None:
        return None, {}
    if isinstance(value, dict):
        if "score" not in value:
            raise BadResult(f"returned a dict without 'score' (keys {sorted(value)[:8]}); add a 'score' key")
        extras = {}
        for key, item in value.items():
            if key == "score" or item is None:
                continue
            if key in COUNT_KEYS:
                raise BadResult(f"returned the key {key!r}, a name dsv4rl's counts use; rename it")
            extras[str(key)] = _number(item, f"its {key!r}")
        score = value["score"]
        return (None if score is None else _number(score, "its 'score'")), extras
    if isinstance(value, str | bytes | list | tuple):
        kind = type(value).__name__
        raise BadResult(f"returned {kind} {value!r:.80}; return a float, a dict with 'score', or None")
    return _number(value, "the result"), {}


@dataclass
class Outcome:
    """One function's verdict on one sample: `status` is ok, none (no score), timeout or error."""

    score: float | None
    extras: dict[str, float] = field(default_factory=dict)
    status: str = "ok"
    error: str | None = None  # "TypeError: ... at file.py:12 in score" (timeouts: the limit)
    traceback: str = ""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"score": self.score, "status": self.status}
        if self.extras:
            out["extras"] = self.extras
        if self.error:
            out["error"] = self.error
        return out


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_PACKAGE_DIR = str(Path(__file__).resolve().parents[1])  # src/dsv4rl


def user_frame(traceback_text: str) -> str | None:
    """`file:line in function` of the innermost frame outside dsv4rl and the standard library of a worker's
    traceback (where the user's function raised), or of the innermost frame when every frame is ours."""
    frames = _FRAME.findall(traceback_text or "")
    if not frames:
        return None
    stdlib = str(Path(re.__file__).resolve().parent)
    not_ours = [f for f in frames if not f[0].startswith(_PACKAGE_DIR)]
    theirs = [f for f in not_ours if not f[0].startswith(stdlib) and "site-packages" not in f[0]]
    path, line, function = (theirs or not_ours or frames)[-1]
    return f"{path}:{line} in {function}"
