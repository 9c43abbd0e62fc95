"""Sync reward functions in worker processes, each call under its own deadline, awaited from asyncio.

Why this shape (the failures peers' users report, docs/tasks.md): a reward call never runs in the trainer's
process (a hang there stalls the step), and a timeout is never a signal in the caller (`signal.alarm`
only works on a main thread, and a C loop ignores it). A call that passes its deadline gets its whole pool
killed and a fresh one started; the other calls that were in flight on the killed pool are run again on
the new one (their deadline starts over), so only the slow call is lost. A worker that dies by itself (a
segfault, `os._exit`) gets its call one retry, then the call fails as `WorkerDied`.

At most `num_workers` calls are in flight, so a call's deadline starts when a worker is free to run it.
Workers come from multiprocessing's fork server (they never re-import the trainer's main module) and
import the user's reward modules when they start (`Target`s), so no deadline pays for an import.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Sequence
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from dsv4rl.reward.targets import Target, load_function
from dsv4rl.reward.verify_pool import TIMED_OUT, CallFailed, call_failed

log = logging.getLogger(__name__)

_FUNCTIONS: dict[Target, Callable[..., Any]] = {}


def _worker_init(targets: Sequence[Target]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    for target in targets:
        _FUNCTIONS[target] = load_function(target)


def call_target(target: Target, payload: Any, kwargs: dict[str, Any]) -> Any:
    """In a worker: the user's function on one sample (or one group's samples)."""
    function = _FUNCTIONS.get(target)
    if function is None:
        function = _FUNCTIONS[target] = load_function(target)
    result = function(payload, **kwargs)
    if asyncio.iscoroutine(result):
        result.close()
        raise TypeError(f"{target.spec} returned a coroutine: an async function must be declared `async def`")
    return result


def _run_one(fn: Callable[..., Any], args: tuple) -> tuple[str, Any]:
    try:
        return "ok", fn(*args)
    except Exception as error:
        return "error", call_failed(error)


def _ping() -> int:
    time.sleep(0.05)  # long enough that one fast worker cannot answer every ping
    return os.getpid()


def _context() -> multiprocessing.context.BaseContext:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["dsv4rl.reward.graders", "dsv4rl.reward.fn_pool"])
    return context


class AsyncProcessPool:
    """`await pool.call(fn, args, timeout_s)` -> fn's value, TIMED_OUT or CallFailed (from one event loop)."""

    def __init__(
        self,
        num_workers: int,
        targets: Sequence[Target] = (),
        label: str = "reward",
        startup_timeout_s: float = 120.0,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1 (reward.num_workers), got {num_workers}")
        self.num_workers = num_workers
        self.targets = tuple(targets)
        self.label = label
        self.startup_timeout_s = startup_timeout_s
        self.restarts = 0  # pools killed: a call past its deadline, or a worker that died
        self.timeouts = 0
        self._executor: cf.ProcessPoolExecutor | None = None
        self._generation = 0  # bumped at every kill: a call that sees it change was not at fault
        self._slots: asyncio.Semaphore | None = None
        self._starting: asyncio.Lock | None = None

    # ------------------------------------------------------------------ the pool
    def _start(self) -> cf.ProcessPoolExecutor:
        executor = cf.ProcessPoolExecutor(
            self.num_workers, mp_context=_context(), initializer=_worker_init, initargs=(self.targets,)
        )
        seen: set[int] = set()
        deadline = time.monotonic() + self.startup_timeout_s
        try:  # every worker started and initialised (the user's modules imported) before any deadline
            while len(seen) < self.num_workers:
                pings = [executor.submit(_ping) for _ in range(self.num_workers)]
                for future in pings:
                    seen.add(future.result(timeout=max(0.0, deadline - time.monotonic())))
        except Exception as error:
            _kill(executor)
            raise RuntimeError(
                f"{self.label} worker processes did not start ({error!r}); does every reward module import "
                "on its own (python -c 'import <module>')?"
            ) from error
        return executor

    async def _ensure(self) -> tuple[cf.ProcessPoolExecutor, int]:
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._executor is None:
                self._executor = await asyncio.to_thread(self._start)
            return self._executor, self._generation

    def _kill(self, generation: int) -> None:
        """Kill the pool of `generation` (once: a later call that saw the same pool finds it gone)."""
        if self._executor is not None and generation == self._generation:
            _kill(self._executor)
            self._executor = None
            self._generation += 1
            self.restarts += 1

    # ------------------------------------------------------------------ calls
    async def call(self, fn: Callable[..., Any], args: tuple, timeout_s: float) -> Any:
        """fn(*args) in a worker within `timeout_s` seconds: its value, TIMED_OUT, or CallFailed (it raised,
        its result could not come back, or its worker died twice)."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.num_workers)
        deaths = 0
        async with self._slots:
            while True:
                executor, generation = await self._ensure()
                try:
                    future = executor.submit(_run_one, fn, args)
                except (BrokenProcessPool, RuntimeError):  # killed under us between ensure and submit
                    self._kill(generation)
                    continue
                waiting = asyncio.wrap_future(future)
                try:
                    status, value = await asyncio.wait_for(asyncio.shield(waiting), timeout_s)
                except TimeoutError:
                    waiting.add_done_callback(_consume)  # it fails with the killed pool: nobody waits on it
                    self.timeouts += 1
                    self._kill(generation)
                    log.warning("%s call took over %.1f s: its worker pool was killed and restarted",
                                self.label, timeout_s)  # fmt: skip
                    return TIMED_OUT
                except (BrokenProcessPool, asyncio.CancelledError) as error:
                    if isinstance(error, asyncio.CancelledError) and not future.cancelled():
                        raise  # this task was cancelled, not the pool's future
                    if generation != self._generation:
                        continue  # another call's deadline killed the pool: run this one again
                    deaths += 1
                    self._kill(generation)
                    if deaths >= 2:
                        return CallFailed("WorkerDied", "the worker process died twice running this call")
                    continue
                except Exception as error:  # the result could not be pickled back
                    return call_failed(error)
                return value  # status "error": a CallFailed

    def close(self) -> None:
        if self._executor is not None:
            _kill(self._executor)
            self._executor = None


def _consume(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


def _kill(executor: cf.ProcessPoolExecutor) -> None:
    processes = list((getattr(executor, "_processes", None) or {}).values())  # no public API < 3.14
    for process in processes:
        if process.is_alive():
            process.kill()
    executor.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.join(timeout=5)
