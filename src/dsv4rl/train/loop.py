"""The RL loop, one step top to bottom: rollout -> reward -> advantages -> train -> weight sync.

Every training rank runs `RLLoop.run`; rank 0 also drives the engines (rollout and weight sync)
and writes metrics. The other ranks receive each step's batch from rank 0 and train on their
shard; with pipeline stages, each stage's source rank sends its own stage's weights. Nothing here
knows which trainer backend or which rollout engine is behind the seams.

Colocated (`parallel.colocate`), the engines' memory moves around training (`dsv4rl.engine_client.colocated`):
rollout -> release -> train -> resume weights -> push by tensor handles -> resume KV cache -> next step.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from dsv4rl.aio import run_on
from dsv4rl.algo.dapo import flat_group_fraction
from dsv4rl.algo.families import compute_advantages, keep_groups, sampling_done, shape_rewards
from dsv4rl.algo.staleness import partial_fraction, staleness_bound, staleness_metrics
from dsv4rl.config.choices import MemoryTag
from dsv4rl.config.schema import Config
from dsv4rl.data.chat_response import response_split_metrics
from dsv4rl.data.problems import Problem
from dsv4rl.engine_client.client import EngineError
from dsv4rl.engine_client.colocated import KV_AND_GRAPHS
from dsv4rl.engine_client.roster import restart_budget
from dsv4rl.faults import heartbeat
from dsv4rl.faults.failed_push import write_failed_push
from dsv4rl.faults.notices import notify
from dsv4rl.faults.stop import StopSignals, write_stopped
from dsv4rl.metrics import MetricsWriter, StepTimer
from dsv4rl.reward.combine import combine, grader_counts
from dsv4rl.rollout.trajectory import trajectory_metrics
from dsv4rl.samples import Sample
from dsv4rl.sync.stages import StagedWeightSync
from dsv4rl.sync.weight_sync import SyncStats, WeightSyncError
from dsv4rl.trackers.hub import Trackers, open_trackers
from dsv4rl.train.backend import TrainerBackend
from dsv4rl.train.batch import TrainBatch
from dsv4rl.train.checkpoint import checkpoint_dir, latest_checkpoint, load_newest
from dsv4rl.train.driver import Driver
from dsv4rl.train.learning_signal import FlatRewardWatch
from dsv4rl.train.nonfinite import require_finite_weights
from dsv4rl.train.preempt import BoundaryStop
from dsv4rl.train.rewarding import generate_and_score
from dsv4rl.train.rollout_ahead import RolloutAhead, overlap_seconds
from dsv4rl.train.rollout_records import saves_rollouts, write_rollouts
from dsv4rl.train.rollout_stream import RolloutStream, groups_to_lists

log = logging.getLogger(__name__)


def sync_metrics(stats: SyncStats | None) -> dict[str, float | str]:
    """Where one weight sync's time went, and how it travelled (broadcast or tensor), for metrics.jsonl."""
    if stats is None:
        return {"sync_bytes": 0, "sync_gb_per_s": 0.0}
    return {
        "sync_transport": stats.transport.value,
        "sync_bytes": stats.bytes,
        "sync_gb_per_s": stats.gb_per_s,
        "sync_transfer_s": stats.transfer_seconds,
        "sync_pipeline_s": stats.pipeline_seconds,
        "sync_control_s": stats.control_seconds,
        "sync_sources": stats.sources,
    }


class RLLoop:
    """`driver` on rank 0 only; `weight_sync` on every rank (connected); `probe` ([N, L] token ids, the
    same on every rank) enables the log-prob probe after syncs; `stop_signals`: this rank's SIGTERM/SIGUSR1
    (a graceful stop at the next step boundary also comes from `<run_dir>/STOP`)."""

    def __init__(
        self,
        cfg: Config,
        backend: TrainerBackend,
        run_dir: Path,
        driver: Driver | None,
        weight_sync: StagedWeightSync,
        probe: torch.Tensor | None = None,
        stop_signals: StopSignals | None = None,
    ) -> None:
        self.cfg = cfg
        self.backend = backend
        self.run_dir = run_dir
        self.driver = driver
        self.weight_sync = weight_sync
        self.probe = probe
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.checkpoint_root = run_dir / "checkpoints"
        self.writer: MetricsWriter | None = None
        self.trackers: Trackers | None = None  # rank 0: the recipe's `logger` trackers (dsv4rl.trackers)
        self.resumed_trackers: dict | None = None  # the tracker state the resumed checkpoint kept
        self.flat_watch = FlatRewardWatch(cfg)  # rank 0: says when no group has given a gradient for a while
        self.syncs = 0  # weight syncs done by this process (the first one is always verified)
        self.stop = BoundaryStop(run_dir, self.rank, getattr(backend, "device", None), stop_signals)
        self.saved_step: int | None = None  # the step of the last checkpoint this process wrote
        self.stopped_at: int | None = None  # the step boundary a graceful stop left the loop at
        self.restarts_on = restart_budget(cfg) > 0  # a lost engine: its requests resent, the group rebuilt
        bound = staleness_bound(cfg.algo)
        # algo.max_staleness=1 (async_rollout): rank 0 generates the next step's batch while this one trains
        self.ahead = (
            RolloutAhead(lambda step: self.collect_batch(step, StepTimer(), background=True))
            if bound == 1 and driver is not None
            else None
        )
        # algo.max_staleness >= 2: the engines generate without pause; each step takes finished groups
        self.stream = RolloutStream(cfg, driver, bound) if bound >= 2 and driver is not None else None

    # ----------------------------------------------------------------- setup
    def resume(self) -> int:
        """Load the newest checkpoint when `resume=true`; returns the step it holds (0 when none)."""
        if not self.cfg.resume:
            return 0
        checkpoint = latest_checkpoint(self.checkpoint_root)
        if checkpoint is None:
            if self.rank == 0:  # resume=auto: a fresh run, as asked
                level = logging.INFO if self.cfg.resume == "auto" else logging.WARNING
                log.log(level, "resume=%s but %s has no checkpoint: starting from step 0", self.cfg.resume,
                        self.checkpoint_root)  # fmt: skip
            return 0
        heartbeat.enter("resume")
        # the newest that loads (each rank's RNG states too); an unreadable one is named, the next tried
        checkpoint, extra = load_newest(self.checkpoint_root, self.backend.load_checkpoint)
        if self.driver is not None:
            self.driver.stream.load_state_dict(extra["data"])
            self.resumed_trackers = extra.get("trackers")
        if self.stream is not None and extra.get("rollout_stream") is not None:
            self.stream.load_state_dict(extra["rollout_stream"])  # the data cursor included
        if self.ahead is not None and extra.get("pending_rollout") is not None:
            self.ahead.restore(extra["pending_rollout"])  # generated before the stop, not yet trained
        if self.rank == 0:
            log.info("resumed from %s (step %d)", checkpoint, extra["step"])
        return int(extra["step"])

    # ------------------------------------------------------------------ loop
    def run(self) -> None:
        start = self.resume()
        if self.driver is not None:  # a resumed run drops the lines of steps after its checkpoint
            self.writer = MetricsWriter(self.driver.metrics_path, resume_from_step=start)
            self.trackers = open_trackers(self.cfg, self.run_dir, self.resumed_trackers, start)
        # The engines start from the model directory; after a resume they must hold the resumed weights.
        heartbeat.enter("sync", start)
        self.sync_weights(version=start)
        if self.stream is not None:
            self.stream.start(version=start)
        finished = False
        try:
            for step in range(start + 1, self.cfg.train.steps + 1):
                if self.stop_before(step, start):
                    break
                self.step(step)
                every = self.cfg.train.checkpoint_every
                if every and (step % every == 0 or step == self.cfg.train.steps):
                    self.save_checkpoint(step)
            finished = True
        finally:
            if self.ahead is not None:
                self.ahead.close(wait=finished)
            if self.stream is not None:
                self.stream.close()
            if self.trackers is not None:  # the launcher adds the outcome (dsv4rl.trackers.outcome)
                self.trackers.close()
        heartbeat.enter("shutdown", self.cfg.train.steps)

    def stop_before(self, step: int, start: int) -> bool:
        """At the boundary before `step`, collectively: when a stop was asked for, checkpoint the step just
        done (unless saved already, or none was done since `start`), record the stop, leave the loop."""
        reason = self.stop.requested()
        if reason is None:
            return False
        done, began = step - 1, time.monotonic()
        if done > start and self.saved_step != done:
            self.save_checkpoint(done)
        checkpoint = str(checkpoint_dir(self.checkpoint_root, done)) if done > 0 else None
        if self.rank == 0:
            write_stopped(self.run_dir, done, checkpoint, reason)
            log.warning("stopping after step %d (%s); checkpoint %s, written in %.1f s", done, reason,
                        checkpoint, time.monotonic() - began)  # fmt: skip
        if self.world_size > 1:
            dist.barrier()  # no rank exits before the record: each node's supervisor reads it
        self.stopped_at = done
        return True

    @staticmethod
    @contextmanager
    def phase(timer: StepTimer, name: str, step: int) -> Iterator[None]:
        """Time a phase of the step, and tell the supervisor's hang watchdog that this rank entered it."""
        heartbeat.enter(name, step)
        with timer.phase(name):
            yield

    def step(self, step: int) -> None:
        timer = StepTimer()
        if self.rank != 0:
            heartbeat.enter("wait_batch", step)  # for rank 0's batch
        batch, rollout_metrics = self.rollout(step, timer) if self.rank == 0 else (None, {})
        if self.driver is not None and self.driver.colocated is not None:
            with self.phase(timer, "offload", step):  # colocated: the engines give the devices back
                self.driver.colocated.release()
        batch = self.share_batch(batch)
        train_start = time.monotonic()
        with self.phase(timer, "train", step):
            train_metrics = self.backend.train_step(
                batch.shard(
                    self.backend.data_parallel_rank,
                    self.backend.data_parallel_size,
                    num_mini_batches=self.cfg.algo.updates_per_step,
                ),
                temperature=self.cfg.algo.sampling.temperature,
            )
        if self.ahead is not None:  # the engines finish the next batch on these weights, then take new ones
            train_end = time.monotonic()
            with self.phase(timer, "wait_rollout", step):
                upcoming = self.ahead.wait()
            if upcoming is not None:
                rollout_metrics["async_overlap_s"] = overlap_seconds(upcoming, train_start, train_end)
        with self.phase(timer, "sync", step):
            sync_stats, due = self.push_weights(version=step)
        if self.stream is not None:
            self.stream.advance(step)  # the engines hold this step's weights: more groups may start
        with self.phase(timer, "verify", step):
            verify_metrics = self.verify_sync(step, sync_stats, due)
        eval_metrics = {}
        evaluator = self.driver.evaluator if self.driver is not None else None
        if evaluator is not None and evaluator.due(step):
            with self.phase(timer, "eval", step):  # the engines hold this step's weights now
                eval_metrics = self.on_live_engines(partial(evaluator.run, step))
        if self.driver is not None:
            metrics = {"step": step, **train_metrics, **timer.as_metrics(), **rollout_metrics}
            if "rollout/engine_idle_fraction" not in metrics:  # K <= 1: the engines generate in the rollout
                generating = metrics.get("time_rollout_s", 0.0) / max(metrics["time_step_s"], 1e-9)
                metrics["rollout/engine_idle_fraction"] = min(1.0, max(0.0, 1.0 - generating))
            metrics.update(sync_metrics(sync_stats), **verify_metrics, **eval_metrics)
            if self.driver.roster is not None:
                metrics.update(self.driver.roster.metrics())  # engine/restarts, engine/alive, rollout/resent
            self.writer.write(metrics)
            if self.trackers is not None:  # after metrics.jsonl; a tracker that fails is dropped
                self.trackers.log_step(step, metrics)
            flat = self.flat_watch.observe(metrics)
            if flat is not None:
                notify(flat, log)

    # -------------------------------------------------------- rank 0: rollout
    def rollout(self, step: int, timer: StepTimer) -> tuple[TrainBatch, dict[str, float]]:
        """This step's batch: generated now, or (async) the one generated while the last step trained,
        whose rollout and reward times it carries; then the next step's rollout starts."""
        if self.stream is not None:
            with self.phase(timer, "wait_rollout", step):
                taken = self.stream.take(step)
            batch, metrics = self.assemble(step, timer, *groups_to_lists(taken))
            return batch, {**metrics, **taken.metrics}
        if self.ahead is None:
            return self.collect_batch(step, timer)
        with self.phase(timer, "wait_rollout", step):  # only the first step (or a resume) waits here
            ready = self.ahead.take(step)
        if step < self.cfg.train.steps:
            self.ahead.submit(step + 1)
        return ready.batch, dict(ready.metrics)

    def collect_batch(
        self, step: int, timer: StepTimer, background: bool = False
    ) -> tuple[TrainBatch, dict[str, float]]:
        """Rollout and reward of `step`'s prompts. `background` (async): on a thread of its own, so the
        phases are timed into the metrics, not reported to the watchdog as the rank's phase.

        Each prompt's group is scored as soon as it is back (`generate_and_score`): `time_rollout_s` is
        the generation, `time_reward_s` the scoring left after the last sample came back."""

        def phase(name: str) -> contextlib.AbstractContextManager:
            return timer.phase(name) if background else self.phase(timer, name, step)

        driver = self.driver
        algo = self.cfg.algo
        problems = driver.stream.next_batch()
        kept: list[Sample] = []
        every: list[Sample] = []  # every sample generated this step (dynamic sampling drops some)
        outcomes: list[dict] = []
        prompts: list[Problem] = []  # each sample's problem
        all_parts = []  # reasoning and answer of every response (data.chat_format=deepseek_v4)
        attempt = 0
        wanted = len(problems) * algo.group_size
        while True:
            with phase("rollout"):  # the scoring runs with it; what it left after the generation is "reward"
                round_ = run_on(
                    driver.event_loop,
                    generate_and_score(self.cfg, driver, problems, step, attempt, len(every)),
                )
            timer.move("rollout", "reward", round_.reward_tail_s)
            samples = round_.samples
            every += samples
            prompts += round_.problems
            outcomes += round_.outcomes
            all_parts += round_.parts or []
            combined = combine(driver.rewards.specs, round_.outcomes)
            rewards = shape_rewards(algo, combined.totals, [len(s.response_ids) for s in samples])
            for sample, reward, scored in zip(samples, rewards.tolist(), combined.scored, strict=True):
                sample.reward, sample.excluded = reward, not scored
            keep = keep_groups(algo, rewards, torch.tensor(combined.scored))  # None: dynamic sampling off
            if keep is None:
                kept = samples
                break
            kept += [s for s in samples if keep[s.group]]  # over-sample to refill the batch
            attempt += 1
            if sampling_done(algo, len(kept), wanted, attempt, len(problems)):
                break
            problems = driver.stream.next_batch()
        kept = kept[:wanted] if len(kept) > wanted else kept
        return self.assemble(step, timer, kept, every, prompts, outcomes, all_parts or None, background)

    def assemble(
        self,
        step: int,
        timer: StepTimer,
        kept: list[Sample],
        every: list[Sample],
        prompts: list[Problem],
        outcomes: list[dict],
        all_parts: list | None,
        background: bool = False,
    ) -> tuple[TrainBatch, dict[str, float]]:
        """The batch of `kept` (scored, rewards shaped) with advantages, the step's metrics over `every`
        sample generated for it, and its rollout records."""
        driver = self.driver
        algo = self.cfg.algo
        step_rewards = driver.rewards.combine(outcomes)  # too many errors of one function stop the run here
        kept = self.fit_to_data_parallel(kept)
        rewards = torch.tensor([s.reward for s in kept])
        scored = torch.tensor([not s.excluded for s in kept])
        advantages = compute_advantages(algo, rewards, scored)
        for sample, advantage in zip(kept, advantages.tolist(), strict=True):
            sample.advantage = advantage
        batch = TrainBatch.from_samples(kept, pad_id=driver.tokenizer.pad_token_id)
        trained = [s.reward for s in every if not s.excluded]
        reward_tensor = torch.tensor(trained if trained else [float("nan")])
        lengths = [len(s.response_ids) for s in every]
        metrics = {
            "reward_mean": reward_tensor.mean().item(),
            "reward_std": reward_tensor.std().item() if len(trained) > 1 else 0.0,
            "response_len_mean": float(np.mean(lengths)),  # multi-turn: the trajectory, inserted tokens too
            "truncated_fraction": sum(s.truncated for s in every) / len(every),
            # groups with no gradient, over every group generated (dynamic sampling drops them later)
            "reward/zero_std_fraction": flat_group_fraction(
                torch.tensor([s.reward for s in every]),
                algo.group_size,
                torch.tensor([not s.excluded for s in every]),
            ),
            "samples": len(every),
            "samples_trained": len(kept),
            **grader_counts(step_rewards.metrics, driver.rewards.specs),
            **step_rewards.metrics,  # reward/<name>/score and counts, reward_excluded
            **(response_split_metrics(all_parts) if all_parts else {}),
            **trajectory_metrics(every),  # tool/*, turns_mean, finish/*, masked_token_fraction
            # the weights this batch trains are version step - 1: how far behind they were generated
            **staleness_metrics([s.weight_version for s in kept], step - 1),
            "partial/fraction": partial_fraction([s.versions for s in kept]),
            # what the filter kept (dynamic sampling; the stream's filter): samples trained of those generated
            "oversample/kept_fraction": len(kept) / len(every),
        }
        if background:
            metrics.update({f"time_{name}_s": seconds for name, seconds in timer.seconds.items()})
        if saves_rollouts(self.cfg.run.save_rollouts, step):
            decode = driver.multi_turn.runner.format.decode if driver.multi_turn is not None else None
            write_rollouts(self.run_dir, step, every, prompts, outcomes, all_parts, kept, decode)
        return batch, metrics

    def fit_to_data_parallel(self, samples: list[Sample]) -> list[Sample]:
        """Whole groups only, and a count every data-parallel rank can take an equal share of."""
        group_size = self.cfg.algo.group_size
        groups = len(samples) // group_size
        while groups > 0 and (groups * group_size) % self.backend.data_parallel_size:
            groups -= 1
        if groups == 0:
            raise RuntimeError(
                "dynamic sampling left no group with differing rewards; raise "
                "algo.dynamic_sampling.max_oversample_factor or turn dynamic sampling off"
            )
        kept = samples[: groups * group_size]
        for index, sample in enumerate(kept):
            sample.group = index // group_size
        return kept

    def share_batch(self, batch: TrainBatch | None) -> TrainBatch:
        if self.world_size == 1:
            return batch
        box = [batch]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    # ------------------------------------------------------------ weight sync
    def sync_weights(self, version: int) -> tuple[SyncStats | None, dict[str, float]]:
        """Push the weights, then run the checks that are due (`push_weights`, `verify_sync`)."""
        stats, due = self.push_weights(version)
        return stats, self.verify_sync(version, stats, due)

    def push_weights(self, version: int) -> tuple[SyncStats | None, bool]:
        """Every rank takes part in gathering full tensors; rank 0 (and each other pipeline stage's
        source rank) broadcasts them to the engines. Returns the stats (rank 0) and whether the checks of
        `sync.verify` are due after this sync (the first one always is, and one that an engine rejoined at).

        With engine restarts on, the group first follows the engines (`regroup_engines`), and a push that
        failed because an engine was lost during it is made again once to the engines that answer."""
        verify = self.cfg.sync.verify
        # collective, before anything moves: non-finite weights never reach the engines (NonFiniteError)
        require_finite_weights(self.backend, version, "sync", "nothing was pushed to the engines")
        rejoined = self.regroup_engines(self.engine_members)
        due = self.syncs == 0 or version % max(verify.every_steps, 1) == 0 or rejoined
        self.syncs += 1
        colocated = self.driver.colocated if self.driver is not None else None
        if colocated is not None:  # room for the update first; the KV cache once the push is done
            colocated.resume([MemoryTag.weights])
        for attempt in range(2):
            named = self.backend.named_weights_for_sync(by_stage=self.weight_sync.by_stage)
            try:
                stats = self.weight_sync.push(
                    named, version=str(version), record_checksums=due and verify.checksum
                )
                failure = None
            except WeightSyncError as error:
                failure = error
            if attempt == 0 and self.regroup_engines(partial(self.members_after_failure, failure, version)):
                log.warning("pushing the weights of step %d again, to the engines that answer", version)
                due = True
                continue
            break
        if failure is not None:
            self.record_failed_push(version, failure)
            raise failure
        if colocated is not None:
            colocated.resume(KV_AND_GRAPHS)
        return stats, due

    def engine_members(self) -> list[int] | None:
        """Rank 0, engine restarts on: the engines the group must hold now (None: as it is)."""
        roster = self.driver.roster if self.driver is not None else None
        return run_on(self.driver.event_loop, roster.members_for_sync()) if roster else None

    def members_after_failure(self, failure: WeightSyncError | None, version: int) -> list[int] | None:
        """Rank 0, after `failure` of a push: the group without the engines lost during it, when some were
        and the others can take the push again; or, when the failure left the engines spent, the group of
        the same engines restarted (None: the failure stands)."""
        roster = self.driver.roster if self.driver is not None else None
        if failure is None or roster is None:
            return None
        run = partial(run_on, self.driver.event_loop)
        if self.weight_sync.spent:  # none of them may be pushed to again: fresh processes are
            why = f"the push of step {version} left them spent: {str(failure).splitlines()[0]}"
            timeout_s = self.cfg.engine.startup_timeout_s
            members = run(roster.replace_spent(self.run_dir / "logs", version, why, timeout_s))
            if members is not None:
                self.weight_sync.engines_replaced()
            return members
        lost = run(roster.recheck())
        return run(roster.members_for_sync()) if lost else None

    def regroup_engines(self, decide: Callable[[], list[int] | None]) -> bool:
        """Collective when engine restarts are on: rank 0 `decide`s which engines the weight-update group
        holds; every stage's group is rebuilt with them when that changed. True when it was rebuilt (a
        restarted engine then holds the model it loaded: the push is full, and its probe is due)."""
        if not self.restarts_on:
            return False
        members = decide() if self.driver is not None else None
        # with the members, where each engine listens now (a restarted one may have moved to another port):
        # the other stages' senders hold clients of their own
        urls = [c.base_url for c in self.driver.roster.clients] if members is not None else None
        box = [(members, urls)]
        if self.world_size > 1:
            dist.broadcast_object_list(box, src=0)
        members, urls = box[0]
        if members is None:
            return False
        self.weight_sync.regroup(members, urls)
        if self.driver is not None:
            rejoined = self.driver.roster.regrouped(members)
            self.follow_live_engines()
            if rejoined:
                urls = ", ".join(self.driver.roster.clients[i].base_url for i in rejoined)
                notify(
                    f"engine {urls} rejoined the weight-update group; it takes requests once probed",
                    log,
                )
        return True

    def record_failed_push(self, version: int, error: WeightSyncError) -> None:
        """Rank 0, when the failed push left engines that must be restarted: `<run_dir>/FAILED_PUSH`, from
        which the launcher asks for a requeue with fresh engines (`dsv4rl.faults.failed_push`)."""
        if self.rank != 0 or not self.weight_sync.spent:
            return
        checkpoint = latest_checkpoint(self.checkpoint_root)
        reason = str(error).splitlines()[0]
        path = write_failed_push(self.run_dir, version, str(checkpoint) if checkpoint else None, reason)
        log.error("the push of step %d failed on engines that must be restarted: %s written", version, path)

    def verify_sync(self, version: int, stats: SyncStats | None, due: bool) -> dict[str, float]:
        """The checks of `sync.verify` when `due`: checksums on rank 0, and the log-prob probe, whose
        trainer forward is collective. A failed check raises on rank 0 and the run stops."""
        verify = self.cfg.sync.verify
        metrics: dict[str, float] = {}
        verifier = self.driver.verifier if self.driver is not None else None
        if due and verify.checksum and verifier is not None:
            metrics.update(self.on_live_engines(lambda: verifier.check_checksums(stats.checksums, version)))
        if due and self.probe is not None:
            trainer_logprobs = self.backend.compute_logprobs(self.probe, temperature=1.0)
            if verifier is not None:
                check = partial(verifier.check_probe, self.probe, trainer_logprobs, version)
                metrics.update(self.on_live_engines(check))
        return metrics

    def on_live_engines(self, work: Callable[[], dict[str, float]]) -> dict[str, float]:
        """Rank 0: `work` (a check or an eval on the engines); when it failed because an engine was lost
        meanwhile (engine restarts on), once more on the engines that answer. The lost engine leaves the
        group at the next sync and is probed when it rejoins."""
        try:
            return work()
        except EngineError:
            roster = self.driver.roster
            if roster is None or not run_on(self.driver.event_loop, roster.recheck()):
                raise
        live = self.follow_live_engines()
        log.warning("an engine was lost in a check or an eval: done again on the %d that answer", len(live))
        return work()

    def follow_live_engines(self) -> list:
        """Rank 0: the checks and the eval use the engines that take requests now."""
        live = self.driver.live_clients()
        self.driver.verifier.clients = live  # a rejoined engine is probed before it takes requests
        if self.driver.evaluator is not None:
            self.driver.evaluator.clients = live
        return live

    # ------------------------------------------------------------- checkpoint
    def save_checkpoint(self, step: int) -> None:
        """Model, optimizer, RNG states (saved by the backend) plus the step and the data cursor."""
        heartbeat.enter("checkpoint", step)
        # K >= 2: the producer moves the data cursor, so it is read on its loop with the stream's own state
        streamed = self.stream.state_dict() if self.stream is not None else None
        data = self.driver.stream.state_dict() if self.driver is not None and streamed is None else None
        extra = {"step": step, "data": streamed["data"] if streamed is not None else data}
        if self.trackers is not None:  # a resume continues the same tracker runs
            extra["trackers"] = self.trackers.state_dict()
        if self.ahead is not None:  # the next step's batch, generated before this checkpoint
            extra["pending_rollout"] = self.ahead.pending
        if streamed is not None:  # finished groups not yet trained, problems not yet finished
            extra["rollout_stream"] = streamed
        self.backend.save_checkpoint(str(checkpoint_dir(self.checkpoint_root, step)), extra)
        self.saved_step = step
