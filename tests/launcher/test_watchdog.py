"""The hang watchdog's judgement on heartbeats: when a step is stuck, and which process to name."""

from __future__ import annotations

from dsv4rl.faults.heartbeat import Beat
from dsv4rl.launcher.watchdog import describe, find_hang

NOW = 10_000.0


def beat(
    process: str, phase: str, step: int | None, age: float, progress_age: float | None = None, busy=False
):
    since = NOW - age
    progress_at = since if progress_age is None else NOW - progress_age
    return Beat(process, 100 + len(process), "host", phase, step, since, progress_at, busy)


def test_nothing_is_stuck_before_the_timeout_or_with_the_watchdog_off():
    rank0 = beat("trainer-rank0", "train", 2, age=9.0)
    assert find_hang([rank0], [], timeout_s=10, now=NOW) is None
    assert find_hang([beat("trainer-rank0", "train", 2, age=99.0)], [], timeout_s=0, now=NOW) is None
    assert find_hang([], [beat("engine-0", "generate", None, 99.0, busy=True)], 10, NOW) is None
    assert find_hang([beat("trainer-rank0", "start", None, age=99.0)], [], 10, NOW) is None  # startup


def test_progress_inside_a_long_phase_keeps_it_alive():
    rollout = beat("trainer-rank0", "rollout", 3, age=500.0, progress_age=2.0)  # engines keep answering
    assert find_hang([rollout], [], timeout_s=10, now=NOW) is None
    assert find_hang([beat("trainer-rank0", "rollout", 3, 500.0, progress_age=11.0)], [], 10, NOW) is not None


def test_only_the_ranks_furthest_behind_are_judged():
    # ranks 1 and 2 wait for rank 0's batch without progress of their own; rank 0 gets answers
    waiting = [beat(f"trainer-rank{r}", "wait_batch", 3, age=500.0) for r in (1, 2)]
    assert (
        find_hang([beat("trainer-rank0", "rollout", 3, 500.0, progress_age=1.0), *waiting], [], 10, NOW)
        is None
    )
    # in one phase (the weight sync), one rank's progress counts for all
    syncing = [
        beat("trainer-rank0", "sync", 3, 50.0, progress_age=1.0),
        beat("trainer-rank1", "sync", 3, 50.0),
    ]
    assert find_hang(syncing, [], 10, NOW) is None


def test_a_lone_trainer_stuck_in_train_is_named():
    hang = find_hang(
        [beat("trainer-rank0", "train", 2, age=12.0)], [beat("engine-0", "idle", None, 30.0)], 10, NOW
    )
    assert hang.culprit.process == "trainer-rank0" and hang.where() == "train at step 2"
    assert hang.stalled_for_s == 12.0
    assert hang.headline(10) == (
        "hang: no progress for 12.0 s in phase train at step 2 (run.step_timeout_s=10): "
        "trainer-rank0 did not advance, stuck in train at step 2"
    )


def test_a_rank_left_behind_by_the_others_is_named():
    ranks = [
        beat("trainer-rank0", "sync", 2, age=11.0),  # finished train, waits for rank 1 in the gather
        beat("trainer-rank1", "train", 2, age=14.0),
        beat("trainer-rank2", "sync", 2, age=11.5),
    ]
    hang = find_hang(ranks, [], timeout_s=10, now=NOW)
    assert hang.culprit.process == "trainer-rank1" and hang.stalled_for_s == 14.0
    assert hang.why == (
        "stuck in train at step 2 while the other ranks are further on (trainer-rank0 in sync at step 2, "
        "trainer-rank2 in sync at step 2)"
    )
    # rank 0 evaluating while the others wait for the next batch: rank 0 is behind
    ranks = [beat("trainer-rank0", "eval", 2, age=11.0), beat("trainer-rank1", "wait_batch", 3, age=11.0)]
    assert find_hang(ranks, [], timeout_s=10, now=NOW).culprit.process == "trainer-rank0"


def test_a_busy_engine_is_named_when_the_trainer_waits_on_the_engines():
    trainer = [
        beat("trainer-rank0", "rollout", 1, age=11.0),
        beat("trainer-rank1", "wait_batch", 1, age=11.2),
    ]
    engines = [
        beat("engine-0", "idle", None, age=10.5),
        beat("engine-1", "generate", None, age=10.8, busy=True),
        beat("engine-2", "generate", None, age=0.2, busy=True),  # a fresh batch: moving
    ]
    hang = find_hang(trainer, engines, timeout_s=10, now=NOW)
    assert hang.culprit.process == "engine-1"
    assert hang.why == "busy in generate for 10.8 s while trainer-rank0 waits on it in rollout at step 1"


def test_the_checks_after_a_push_and_the_wait_for_a_background_rollout_wait_on_the_engines():
    """A log-prob probe (phase verify) or a background rollout (wait_rollout) that an engine never
    answers is the engine's hang, not the trainer's (which the supervisor could not restart)."""
    busy = [beat("engine-1", "generate", None, age=10.8, busy=True)]
    for phase, others in (("verify", "verify"), ("wait_rollout", "wait_batch"), ("wait_rollout", "sync")):
        trainer = [beat("trainer-rank0", phase, 4, age=11.0), beat("trainer-rank1", others, 4, age=11.2)]
        hang = find_hang(trainer, busy, timeout_s=10, now=NOW)
        assert hang.culprit.process == "engine-1", (phase, others)
        assert hang.stalled.process == "trainer-rank0"


def test_ranks_stuck_together_name_rank_0():
    trainer = [beat("trainer-rank1", "train", 4, age=13.0), beat("trainer-rank0", "train", 4, age=12.0)]
    busy = [beat("engine-0", "generate", None, 20.0, busy=True)]  # not waited on in train
    hang = find_hang(trainer, busy, timeout_s=10, now=NOW)
    assert hang.culprit.process == "trainer-rank0"
    assert hang.why == "stuck in train at step 4 (all 2 ranks are there)"
    idle = [beat("engine-0", "idle", None, 12.5)]
    hang = find_hang([beat("trainer-rank0", "rollout", 4, age=12.0)], idle, timeout_s=10, now=NOW)
    assert hang.why == "stuck in rollout at step 4; no engine is busy with a request"


def test_describe():
    assert describe(beat("engine-0", "generate", None, 3.25, busy=True), NOW) == (
        "engine-0: busy in generate for 3.2 s (pid 108)"
    )
