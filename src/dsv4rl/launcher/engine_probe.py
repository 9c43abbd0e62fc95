"""Hang detection for engines that write no heartbeat (SGLang): a /health_generate probe while requests
are open.

The reference engine tells the watchdog what it is busy with (`dsv4rl.faults.heartbeat`), so a batch that
never ends is pinned on it. SGLang writes no heartbeat: a scheduler stuck in a kernel or a collective only
shows as a trainer waiting in its rollout, which the watchdog blames on the trainer after
`run.step_timeout_s` (long on a real run) and stops everything. So while the trainer's rank 0 is in a phase
where generate requests may be open, the supervisor probes each such engine of its node every
`engine.health_timeout_s`. SGLang 0.5.23 answers `/health_generate` with 200 as soon as its scheduler emits
any output (a busy engine does so every iteration) and 503 when none came for 20 s, so a working engine
answers at once under load, and a missing answer means a stuck scheduler. Two probes in a row without a
200 within `engine.health_timeout_s` make the engine hung: the supervisor kills it to restart it
(`engine.max_restarts`), and the trainer resends its requests to the others.

No probe runs while the trainer pushes weights (phase `sync`: an engine loading weights answers no
generate, by design), verifies them, checkpoints or starts: there the engines are not generating, and a hung
weight update is the step watchdog's to find.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import httpx

from dsv4rl.config.choices import ProcessRole, RolloutEngineKind
from dsv4rl.faults.heartbeat import Beat
from dsv4rl.launcher.plan import ProcessSpec

__all__ = ["GENERATING_PHASES", "SilentEngineProbe", "requests_open", "silent_engines"]

# The trainer's phases in which generate requests may be open (`train` and `wait_rollout`: with
# algo.max_staleness >= 1 the next batches generate while this one trains). The stream (K >= 2) also has
# requests open in `sync` and `verify`, left out on purpose: a probe there may meet a weight update.
GENERATING_PHASES = frozenset({"rollout", "reward", "eval", "train", "wait_rollout"})
MISSES = 2  # probes in a row without an answer that make an engine hung: one may be a slow moment


def silent_engines(specs: Iterable[ProcessSpec]) -> list[tuple[str, str]]:
    """(name, health URL) of the engines in `specs` that write no heartbeat (the plan's "kind" says which)."""
    engines = [spec for spec in specs if spec.role == ProcessRole.engine and spec.health_url]
    return [(s.name, s.health_url) for s in engines if s.meta.get("kind") == RolloutEngineKind.sglang]


def requests_open(trainer_beats: Iterable[Beat]) -> bool:
    """Whether the trainer's rank 0 (it alone talks to the engines) is in a phase with requests open."""
    return any(beat.process.endswith("-rank0") and beat.phase in GENERATING_PHASES for beat in trainer_beats)


def answers(url: str, timeout_s: float) -> bool:
    try:
        return httpx.get(url, timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class _Target:
    name: str
    url: str
    misses: int = 0
    probe: cf.Future[bool] | None = None
    sent: float = float("-inf")
    sent_in: int = 0  # the stretch of open requests the probe was sent in


@dataclass
class SilentEngineProbe:
    """`targets`: (name, health URL) of this node's engines that write no heartbeat. `observe` is called
    from the supervisor's watch loop about once a second and never blocks: probes run on threads."""

    targets: Sequence[tuple[str, str]]
    timeout_s: float
    misses: int = MISSES
    probe: Callable[[str, float], bool] = answers
    clock: Callable[[], float] = time.monotonic
    _targets: dict[str, _Target] = field(init=False)
    _pool: cf.ThreadPoolExecutor | None = field(init=False, default=None)
    _stretch: int = field(init=False, default=0)  # counts the stretches of open requests
    _was_open: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self._targets = {name: _Target(name, url) for name, url in self.targets}
        if self._targets and self.timeout_s > 0:
            self._pool = cf.ThreadPoolExecutor(len(self._targets), thread_name_prefix="dsv4rl-engine-probe")

    def observe(self, open_requests: bool, skip: Iterable[str] = ()) -> list[str]:
        """The engines found hung now (each reported once, then probed afresh). `open_requests`: the
        trainer may have requests open (`requests_open`); otherwise no probe starts and misses are
        forgotten. `skip`: engines not to probe now (restarted and still loading)."""
        if self._pool is None:
            return []
        if open_requests and not self._was_open:
            self._stretch += 1
        self._was_open = open_requests
        skipped, hung, now = set(skip), [], self.clock()
        for target in self._targets.values():
            if target.probe is not None and target.probe.done():
                answered = target.probe.result()
                target.probe = None
                # only a probe sent and answered within one stretch of open requests counts: one that
                # outlived it may have met a weight update
                if open_requests and target.sent_in == self._stretch and target.name not in skipped:
                    target.misses = 0 if answered else target.misses + 1
                if target.misses >= self.misses:
                    target.misses = 0
                    hung.append(target.name)
                    continue
            if not open_requests or target.name in skipped:
                target.misses = 0
                continue
            if target.probe is None and now - target.sent >= self.timeout_s:
                target.sent, target.sent_in = now, self._stretch
                target.probe = self._pool.submit(self.probe, target.url, self.timeout_s)
        return hung

    def follow(self, name: str, url: str) -> None:
        """Engine `name` now answers at `url` (restarted on another port); its misses start afresh."""
        if name in self._targets:
            self._targets[name] = _Target(name, url)

    def describe(self, name: str) -> str:
        return (
            f"{name} did not answer /health_generate within engine.health_timeout_s={self.timeout_s:g} s "
            f"{self.misses} times in a row while the trainer had requests open"
        )

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
