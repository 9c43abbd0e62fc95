"""Run grader calls (math-verify, and every grader in eval) in worker processes with per-call timeouts
that work from any thread.

math-verify's own timeout uses SIGALRM, which only works on the main thread of the main process, so
it is disabled here (`parsing_timeout=None`, `timeout_seconds=None`) and replaced by two layers:

1. Calls go to a `ProcessPoolExecutor` in chunks; a worker runs each call of a chunk under its own
   SIGALRM timer (a pool worker executes tasks on its main thread), so a slow call costs `timeout_s`
   and is reported as timed out while the rest of the chunk goes on.
2. The caller also holds a wall-clock deadline per chunk (timeout_s per call + a grace). A call stuck
   where no signal gets through (a long C loop) misses it: the workers are killed, a fresh pool is
   started, and that chunk's calls are run again one at a time so only the stuck call is lost.

At most `num_workers` chunks are in flight, so a deadline starts when a worker is free to run it.
A call that raises is returned as a `CallFailed` naming the exception's type (never silently "wrong":
the caller counts them and stops a run when too many fail, `graders.grade_responses`).

Workers are forked from a fork server (multiprocessing's "forkserver") that has imported the graders
once: a worker starts in milliseconds and never re-imports the caller's main module (a trainer's
`python -m dsv4rl.train.worker` would cost each worker a torch import), so restarting the pool after a
kill is cheap. Functions sent to the pool must be importable by module name.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import logging
import multiprocessing
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


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
    return CallFailed(_type_name(exc), str(exc), "".join(traceback.format_exception(exc)))


class _CallTimeout(BaseException):
    """Raised by the worker's alarm; a BaseException so `except Exception` in the callee can't eat it."""


def _on_alarm(signum, frame):
    raise _CallTimeout


def _worker_init(warm_math_verify: bool) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled" notices
    if warm_math_verify:
        import math_verify  # noqa: F401  (pay the sympy import once, before any deadline runs)


def _context() -> multiprocessing.context.BaseContext:
    """The fork server's context; its preload imports the graders once (no effect once it runs)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["dsv4rl.reward.graders"])
    return context


def _ping() -> int:
    time.sleep(0.05)  # long enough that one fast worker cannot answer every ping
    return os.getpid()


def _run_chunk(fn: Callable[..., Any], calls: list[tuple], timeout_s: float) -> list[tuple[str, Any]]:
    """In the worker: ("ok", value) | ("timeout", None) | ("error", CallFailed) per call."""
    out: list[tuple[str, Any]] = []
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    try:
        for args in calls:
            try:
                signal.setitimer(signal.ITIMER_REAL, timeout_s)
                try:
                    value = fn(*args)
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                out.append(("ok", value))
            except _CallTimeout:
                out.append(("timeout", None))
            except Exception as e:
                out.append(("error", call_failed(e)))
    finally:
        signal.signal(signal.SIGALRM, previous)
    return out


def _gold_text(ground_truth: str) -> str:
    """math-verify extracts LaTeX only from delimited text: wrap a bare answer ("\\frac{1}{2}") in $...$."""
    return ground_truth if ("$" in ground_truth or "\\boxed" in ground_truth) else f"${ground_truth}$"


def verify_answer(response: str, ground_truth: str) -> bool:
    """math-verify: `verify(parse(gold), parse(response))`, gold first; math-verify's timeouts off.

    Nothing is caught here: math-verify already turns an input it cannot parse or compare into "no
    match" (`raise_on_error=False`), so what escapes is a real failure (an API change, a missing
    dependency) that the pool reports as `CallFailed` rather than as a wrong answer.
    """
    from math_verify import parse, verify

    gold = parse(_gold_text(ground_truth), parsing_timeout=None)
    pred = parse(response, parsing_timeout=None)
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=None))


@dataclass
class PoolRound:
    """One `VerifyPool.run`: a result per call (a value, TIMED_OUT or CallFailed) and the pool restarts."""

    results: list[Any]
    restarts: int = 0


class VerifyPool:
    """A process pool whose calls have timeouts; usable from any thread (calls are serialised).

    `label` names the calls in log lines; `warm_math_verify` imports math-verify in each worker as it
    starts (so no deadline pays for sympy's import).
    """

    def __init__(
        self,
        num_workers: int = 1,
        timeout_s: float = 5.0,
        chunk_size: int = 16,
        grace_s: float = 2.0,
        startup_timeout_s: float = 120.0,
        label: str = "math-verify",
        warm_math_verify: bool = True,
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 (reward.timeout_s), got {timeout_s}")
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.chunk_size = max(1, chunk_size)
        self.grace_s = grace_s
        self.startup_timeout_s = startup_timeout_s
        self.label = label
        self.warm_math_verify = warm_math_verify
        self.restarts = 0  # pools killed (a call stuck past its deadline, or a worker died)
        self.timeouts = 0  # calls that ran out of time
        self.failures = 0  # calls that raised, or whose worker died twice
        self._executor: cf.ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def _ensure(self) -> cf.ProcessPoolExecutor:
        if self._executor is None:
            executor = cf.ProcessPoolExecutor(
                self.num_workers,
                mp_context=_context(),
                initializer=_worker_init,
                initargs=(self.warm_math_verify,),
            )
            # Start and initialise every worker now, so no deadline pays for process start-up.
            seen: set[int] = set()
            deadline = time.monotonic() + self.startup_timeout_s
            try:
                while len(seen) < self.num_workers:
                    pings = [executor.submit(_ping) for _ in range(self.num_workers)]
                    for f in pings:
                        seen.add(f.result(timeout=max(0.0, deadline - time.monotonic())))
            except Exception as e:
                self._kill(executor)
                raise RuntimeError(f"{self.label} worker processes did not start: {e!r}") from e
            self._executor = executor
        return self._executor

    @staticmethod
    def _kill(executor: cf.ProcessPoolExecutor) -> None:
        processes = list((getattr(executor, "_processes", None) or {}).values())  # no public API < 3.14
        for p in processes:
            if p.is_alive():
                p.kill()
        executor.shutdown(wait=False, cancel_futures=True)
        for p in processes:
            p.join(timeout=5)

    def _restart(self) -> None:
        if self._executor is not None:
            self._kill(self._executor)
            self._executor = None
            self.restarts += 1

    def _timed_out(self, call: tuple, how: str) -> Any:
        self.timeouts += 1
        logger.warning(
            "%s call took over %.1f s (%s; %.200r): graded incorrect", self.label, self.timeout_s, how, call
        )
        return TIMED_OUT

    def _failed(self, call: tuple, failure: CallFailed) -> CallFailed:
        """Counted; logged per call only at DEBUG (graders.grade_responses logs a batch's failures once)."""
        self.failures += 1
        logger.debug(
            "%s call raised %s: %s (%.200r)",
            self.label, failure.error_type, failure.message, call,
        )  # fmt: skip
        return failure

    def map(self, fn: Callable[..., Any], calls: Sequence[tuple]) -> list[Any]:
        """fn(*args) for each args tuple (fn must be picklable), in order; TIMED_OUT / CallFailed where
        a call did not return a value."""
        return self.run(fn, calls).results

    def run(self, fn: Callable[..., Any], calls: Sequence[tuple]) -> PoolRound:
        """`map`, with the number of times the pool was restarted while running these calls."""
        n = len(calls)
        results: list[Any] = [None] * n
        size = max(1, min(self.chunk_size, -(-n // self.num_workers)))
        pending = collections.deque(list(range(s, min(s + size, n))) for s in range(0, n, size))
        deaths = [0] * n
        with self._lock:
            restarts_before = self.restarts
            inflight: dict[cf.Future, tuple[list[int], float]] = {}
            while pending or inflight:
                executor = self._ensure()
                while pending and len(inflight) < self.num_workers:
                    idx = pending.popleft()
                    f = executor.submit(_run_chunk, fn, [calls[i] for i in idx], self.timeout_s)
                    inflight[f] = (idx, time.monotonic() + self.timeout_s * len(idx) + self.grace_s)
                wait_s = max(0.0, min(d for _, d in inflight.values()) - time.monotonic())
                done, _ = cf.wait(list(inflight), timeout=wait_s, return_when=cf.FIRST_COMPLETED)
                broken = False
                for f in done:
                    idx, _ = inflight.pop(f)
                    try:
                        outcomes = f.result()
                    except BrokenProcessPool:
                        broken = True
                        self._retry_after_death(idx, deaths, pending, results, calls)
                        continue
                    except Exception as e:  # the chunk's results could not come back (unpicklable)
                        for i in idx:
                            results[i] = self._failed(calls[i], call_failed(e))
                        continue
                    for i, (status, value) in zip(idx, outcomes, strict=True):
                        if status == "ok":
                            results[i] = value
                        elif status == "timeout":
                            results[i] = self._timed_out(calls[i], "worker alarm")
                        else:
                            results[i] = self._failed(calls[i], value)
                now = time.monotonic()
                expired = [f for f, (_, d) in inflight.items() if d <= now and not f.done()]
                if not expired and not broken:
                    continue
                for f in expired:
                    idx, _ = inflight.pop(f)
                    if len(idx) == 1:
                        results[idx[0]] = self._timed_out(calls[idx[0]], "unresponsive worker killed")
                    else:  # find the stuck call: run the chunk again one call at a time
                        pending.extendleft([i] for i in reversed(idx))
                # The other chunks in flight die with the pool: run them again on the new one.
                for idx, _ in inflight.values():
                    pending.appendleft(idx)
                inflight.clear()
                self._restart()
            return PoolRound(results, self.restarts - restarts_before)

    def _retry_after_death(
        self, idx: list[int], deaths: list[int], pending: collections.deque, results: list, calls: Sequence
    ) -> None:
        for i in idx:
            deaths[i] += 1
        if len(idx) > 1:
            pending.extendleft([i] for i in reversed(idx))
        elif deaths[idx[0]] < 2:
            pending.appendleft(idx)
        else:
            died = CallFailed("WorkerDied", "the worker process died twice running this call")
            results[idx[0]] = self._failed(calls[idx[0]], died)

    def close(self) -> None:
        with self._lock:
            if self._executor is not None:
                self._executor.shutdown(wait=True, cancel_futures=True)
                self._executor = None
