"""Runs the end-to-end tests share. Each `dsv4rl train` costs its start-up (engine, torchrun, sync group)
before its first step, so a run that several tests can assert on is made once per session: the tests
that need a trained model read one 120-step run, and the tests that compare short runs with each other
(same seed, resume, two nodes) compare against one 6-step run."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_runs import LEARNING_STEPS, SHORT_RUN, train


@pytest.fixture(scope="session")
def trained_arith(tmp_path_factory) -> Path:
    """The README's demo: `dsv4rl train recipe=tiny_arith` with the recipe as shipped (120 steps)."""
    run_dir = tmp_path_factory.mktemp("trained_arith") / "run"
    train(run_dir, f"train.steps={LEARNING_STEPS}")
    return run_dir


@pytest.fixture(scope="session")
def short_arith(tmp_path_factory) -> Path:
    """`tiny_arith` for 6 steps (SHORT_RUN): the curve every other run of those settings must equal."""
    run_dir = tmp_path_factory.mktemp("short_arith") / "run"
    train(run_dir, *SHORT_RUN)
    return run_dir
