"""Fully asynchronous rollouts (`algo.max_staleness` K >= 2): the engines generate without waiting for the
trainer, and the trainer takes a batch as soon as enough finished groups are ready.

- Rank 0's event loop runs on a thread of its own for the whole run. On it, the producer starts one
  prompt's group at a time (`generate_and_score` of one problem, on the engine with the fewest groups in
  flight) while admission allows: accepted + running groups < (K + v + 1) x prompts_per_step, v the
  version the engines hold (AReaL's staleness manager), so no more is generated than the next K + 1
  steps can train. A group the filter rejects frees its place; `algo.oversample.factor` runs that many
  times the groups, for a filter that keeps about that share.
- A finished group is scored, its rewards shaped, and filtered (the family's dynamic-sampling filter when
  on, then `algo.oversample.filter`); kept groups wait in the buffer in the order they finished.
- `take(step)` hands over the first prompts_per_step groups. One whose first token is more than K versions
  behind the weights it would train (version step - 1) is dropped and counted (Miles' guard: groups
  finish out of order), and its place goes to a new group.
- Weights are pushed while requests are in flight: the engines pause (`sync.pause_mode`). `in_place` keeps a
  response's tokens and cache and continues it under the new weights (a partial rollout), `retract`
  re-prefills it under the new weights, `abort` ends it: that group is generated again. Each token keeps
  the version that sampled it (`Sample.versions`); staleness counts from the first, and the loss corrects
  every token against its own rollout log-prob (TIS / MIS).
- Which batch a group lands in depends on timing, so a run is not reproducible bit for bit, even with
  `engine.reproducible_sampling` (each group's seeds are fixed: its index in the stream picks them).
- A checkpoint keeps the data cursor, the problems not yet finished (generated again on resume) and the
  finished groups not yet trained.
- Reward limits: each call's `timeout_s` and the step's error and timeout fractions hold as in the
  synchronous loop; `reward.step_timeout_s` (the deadline after a round's last sample) has no round to
  time here and does not apply.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from dataclasses import dataclass, field

import torch

from dsv4rl.aio import run_on
from dsv4rl.algo.families import keep_groups, shape_rewards
from dsv4rl.algo.staleness import admission_capacity, too_stale
from dsv4rl.config.choices import ChatFormat
from dsv4rl.config.compose import reward_base_dirs
from dsv4rl.config.schema import Config
from dsv4rl.data.chat_response import ResponseParts
from dsv4rl.data.problems import Problem
from dsv4rl.reward.combine import combine
from dsv4rl.reward.group_filter import GroupFilter
from dsv4rl.reward.results import Outcome
from dsv4rl.rollout.reward_inputs import reward_inputs
from dsv4rl.rollout.trajectory import final_turn_text
from dsv4rl.samples import Sample
from dsv4rl.train.driver import Driver
from dsv4rl.train.rewarding import generate_and_score

# A step that saw this many batches' worth of groups rejected by the filters, waiting for one batch, stops
# the run: a filter that keeps nothing would otherwise generate forever.
REJECTED_BATCHES_LIMIT = 10


@dataclass
class FinishedGroup:
    """One prompt's scored group, in the order groups finished."""

    index: int  # the group's place in the stream (which prompt it was started for)
    problem: Problem
    samples: list[Sample]
    outcomes: list[dict[str, Outcome]]
    parts: list[ResponseParts] | None
    kept: bool  # passed the filter

    @property
    def head_version(self) -> str:
        """The oldest version any of its samples started from."""
        versions = [s.weight_version for s in self.samples if s.weight_version]
        numeric = [v for v in versions if v.isdigit()]
        if numeric:
            return min(numeric, key=int)
        return versions[0] if versions else ""


@dataclass
class Taken:
    """What a step takes: its groups (kept, the batch), the groups the filter rejected since the last take
    (they count in the step's reward metrics, as dynamic sampling's rounds do), and the stream's metrics."""

    groups: list[FinishedGroup]
    rejected: list[FinishedGroup]
    metrics: dict[str, float] = field(default_factory=dict)


class RolloutStream:
    """The producer on rank 0's event loop (a thread of its own) and the buffer the loop takes batches
    from. `bound` is K, `version` the weights the engines hold when it starts."""

    def __init__(self, cfg: Config, driver: Driver, bound: int) -> None:
        self.cfg = cfg
        self.driver = driver
        self.bound = bound
        self.per_step = cfg.algo.prompts_per_step
        self.oversample = cfg.algo.oversample.factor
        self.filter = GroupFilter.from_config(cfg.algo.oversample, reward_base_dirs(cfg))
        self.loop = driver.event_loop
        self.version = 0
        self.accepted = 0  # groups kept so far: trained or waiting (filtered and dropped ones are not)
        self.next_index = 0  # stream index of the next group to start
        self.queue: collections.deque[tuple[int, Problem]] = collections.deque()  # started next
        self.running: dict[int, tuple[Problem, object]] = {}  # index -> (problem, engine)
        self.buffer: list[FinishedGroup] = []
        self.rejected: list[FinishedGroup] = []  # since the last take
        self.dropped = 0  # groups too stale when taken, since the last take
        self.regenerated = 0  # groups aborted by a pause and started again, since the last take
        self.error: BaseException | None = None
        self._changed: asyncio.Event | None = None
        self._producer: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()  # the groups in flight
        self._thread: threading.Thread | None = None
        self._idle_since: float | None = None  # when the last group in flight came back
        self._idle_s = 0.0  # wall seconds with no group in flight since the last take
        self._since = time.monotonic()

    # ------------------------------------------------------------------ main thread
    def start(self, version: int) -> None:
        """Run the event loop on its own thread and start generating on weights `version`."""
        self.version = version
        self.accepted = max(self.accepted, version * self.per_step + len(self.buffer))
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="dsv4rl-rollout-stream", daemon=True
        )
        self._thread.start()
        run_on(self.loop, self._start())

    def take(self, step: int) -> Taken:
        """Block until `step`'s groups are ready (raising what stopped the producer)."""
        return run_on(self.loop, self._take(step))

    def advance(self, version: int) -> None:
        """The engines hold weights `version` now: more groups may start."""
        run_on(self.loop, self._advance(version))

    def state_dict(self) -> dict:
        """For a checkpoint: the data cursor, the problems not finished (started again on resume) and the
        finished groups not yet trained."""
        return run_on(self.loop, self._state())

    def load_state_dict(self, state: dict) -> None:
        """Before `start`: continue the stream a checkpoint kept."""
        self.driver.stream.load_state_dict(state["data"])
        self.queue = collections.deque(state["unfinished"])
        self.next_index = state["next_index"]
        self.buffer = list(state["buffer"])

    def close(self) -> None:
        """Stop generating (requests in flight are cancelled) and give the event loop back to this thread."""
        if self._thread is None:
            return
        try:
            run_on(self.loop, self._stop())
        finally:
            if self.filter is not None:
                self.filter.close()
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=30)
            self._thread = None

    # ------------------------------------------------------------------ on the loop
    async def _start(self) -> None:
        self._changed = asyncio.Event()
        if self.filter is not None:
            await self.filter.start()
        self._producer = asyncio.ensure_future(self._produce())
        self._producer.add_done_callback(self._on_producer_done)

    async def _stop(self) -> None:
        tasks = [t for t in (self._producer, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _advance(self, version: int) -> None:
        self.version = version
        self._changed.set()

    async def _state(self) -> dict:
        unfinished = [(i, problem) for i, (problem, _) in sorted(self.running.items())] + list(self.queue)
        return {
            "data": self.driver.stream.state_dict(),
            "unfinished": unfinished,
            "next_index": self.next_index,
            "buffer": list(self.buffer),
        }

    def _on_producer_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            self._fail(task.exception())

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self._changed.set()

    def _next_problem(self) -> tuple[int, Problem]:
        if not self.queue:
            for problem in self.driver.stream.next_batch():
                self.queue.append((self.next_index, problem))
                self.next_index += 1
        return self.queue.popleft()

    def _filter_names(self) -> str:
        names = ["algo.dynamic_sampling"] if self.cfg.algo.dynamic_sampling.enabled else []
        names += (
            [f"algo.oversample.filter={self.cfg.algo.oversample.filter}"] if self.filter is not None else []
        )
        return " and ".join(names)

    def _least_busy(self) -> object:
        clients = self.driver.live_clients()
        load = collections.Counter(id(engine) for _, engine in self.running.values())
        return min(clients, key=lambda client: load[id(client)])

    async def _produce(self) -> None:
        while True:
            capacity = admission_capacity(
                self.bound, self.version, self.per_step, self.accepted, len(self.running), self.oversample
            )
            if capacity == 0 or self.error is not None:
                self._changed.clear()
                await self._changed.wait()
                continue
            for _ in range(capacity):
                index, problem = self._next_problem()
                engine = self._least_busy()
                if not self.running and self._idle_since is not None:
                    self._idle_s += time.monotonic() - self._idle_since
                    self._idle_since = None
                self.running[index] = (problem, engine)
                task = asyncio.ensure_future(self._generate(index, problem, engine))
                self._tasks.add(task)
                task.add_done_callback(self._on_group_done)

    def _on_group_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._fail(task.exception())

    async def _generate(self, index: int, problem: Problem, engine: object) -> None:
        """One group: generated, scored, filtered, then kept in the buffer or set aside as rejected. It
        counts as running until then, so admission never sees it in neither place."""
        try:
            group = await self._finished_group(index, problem, engine)
        finally:
            del self.running[index]
            if not self.running:
                self._idle_since = time.monotonic()
            self._changed.set()
        if group is None:
            self.queue.appendleft((index, problem))  # a pause with mode abort ended it: generated again
            self.regenerated += 1
        elif group.kept:
            self.accepted += 1
            self.buffer.append(group)
        else:
            self.rejected.append(group)

    async def _finished_group(self, index: int, problem: Problem, engine: object) -> FinishedGroup | None:
        cfg = self.cfg
        nominal = index // self.per_step + 1  # the step it would be trained at, were groups in order
        round_ = await generate_and_score(
            cfg, self.driver, [problem], nominal, index, 0, calls_per_engine=1, clients=[engine]
        )
        if any(s.finish_reason == "abort" for s in round_.samples):
            return None
        combined = combine(self.driver.rewards.specs, round_.outcomes)
        lengths = [len(s.response_ids) for s in round_.samples]
        rewards = shape_rewards(cfg.algo, combined.totals, lengths)
        for sample, reward, scored in zip(round_.samples, rewards.tolist(), combined.scored, strict=True):
            sample.reward, sample.excluded = reward, not scored
        keep = keep_groups(cfg.algo, rewards, torch.tensor(combined.scored))
        kept = keep is None or bool(keep[0])
        if kept and self.filter is not None:
            finals = [final_turn_text(self.driver.tokenizer, s) for s in round_.samples]
            chat = cfg.data.chat_format != ChatFormat.none
            inputs = reward_inputs(problem, round_.samples, round_.parts, nominal, 0, chat, finals)
            kept = await self.filter.keep(inputs, rewards.tolist())
        return FinishedGroup(index, problem, round_.samples, round_.outcomes, round_.parts, kept)

    async def _take(self, step: int) -> Taken:
        trained = step - 1
        while True:
            if self.error is not None:
                raise self.error
            fresh = [g for g in self.buffer if not too_stale(g.head_version, trained, self.bound)]
            if len(fresh) < len(self.buffer):
                self.dropped += len(self.buffer) - len(fresh)
                self.accepted -= len(self.buffer) - len(fresh)  # their places go to new groups
                self.buffer = fresh
                self._changed.set()
            if len(self.buffer) >= self.per_step:
                break
            finished = len(self.buffer) + len(self.rejected)
            sampling = self.cfg.algo.dynamic_sampling
            # dynamic sampling's limit: after max_oversample_factor x the prompts, train on what was kept
            if (
                sampling.enabled
                and self.buffer
                and finished >= sampling.max_oversample_factor * self.per_step
            ):
                break
            if len(self.rejected) >= REJECTED_BATCHES_LIMIT * self.per_step:
                raise RuntimeError(
                    f"the stream's filter rejected {len(self.rejected)} groups while step {step} waited for "
                    f"{self.per_step} (it kept {len(self.buffer)}): {self._filter_names()} keeps (almost) "
                    "nothing; check what it rejects in the rollout records (`dsv4rl rollouts`), or loosen it"
                )
            self._changed.clear()
            await self._changed.wait()
        groups, self.buffer = self.buffer[: self.per_step], self.buffer[self.per_step :]
        rejected, self.rejected = self.rejected, []
        now = time.monotonic()
        idle = self._idle_s + (
            now - self._idle_since if self._idle_since is not None and not self.running else 0.0
        )
        wall = max(now - self._since, 1e-9)
        samples = [s for g in groups for s in g.samples]
        metrics = {
            "partial/fraction": sum(len({v for v in s.versions if v}) > 1 for s in samples)
            / max(len(samples), 1),
            "rollout/engine_idle_fraction": min(1.0, idle / wall),
            "staleness/dropped_groups": float(self.dropped),
            "rollout/regenerated_groups": float(self.regenerated),
            "rollout/groups_in_flight": float(len(self.running)),
            "rollout/groups_waiting": float(len(self.buffer)),
        }
        self.dropped = self.regenerated = 0
        self._idle_s, self._since = 0.0, now
        if self._idle_since is not None:
            self._idle_since = now
        return Taken(groups, rejected, metrics)


def groups_to_lists(
    taken: Taken,
) -> tuple[list[Sample], list[Sample], list[Problem], list[dict[str, Outcome]], list[ResponseParts] | None]:
    """The taken groups as the loop's lists: kept samples, every sample (kept first, then the rejected),
    each sample's problem, each one's outcomes and response parts; groups numbered in that order."""
    ordered = taken.groups + taken.rejected
    every: list[Sample] = []
    problems: list[Problem] = []
    outcomes: list[dict[str, Outcome]] = []
    parts: list[ResponseParts] | None = [] if all(g.parts is not None for g in ordered) and ordered else None
    for number, group in enumerate(ordered):
        for sample in group.samples:
            sample.group = number
        every += group.samples
        problems += [group.problem] * len(group.samples)
        outcomes += group.outcomes
        if parts is not None:
            parts += group.parts
    kept = [s for g in taken.groups for s in g.samples]
    return kept, every, problems, outcomes, parts
