"""The trainer process's own set-up steps (those that talk to the engines: tests/rollout)."""

from __future__ import annotations

import gc

from dsv4rl.train.worker import freeze_own_gc


def test_the_trainer_freezes_what_lives_before_the_first_step() -> None:
    gc.unfreeze()
    try:
        freeze_own_gc()
        frozen = gc.get_freeze_count()
        assert frozen > 10_000  # torch and the test session's modules
        assert gc.collect() >= 0 and gc.get_freeze_count() == frozen  # collections leave them alone
    finally:
        gc.unfreeze()
