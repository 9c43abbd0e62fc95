"""How the end-to-end tests start `dsv4rl train`: as a user would (a subprocess of the CLI), on free ports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from free_ports import port_overrides

CLI = [sys.executable, "-m", "dsv4rl.cli", "train"]
NON_TIMING = ("reward_mean", "reward_std", "response_len_mean", "grad_norm", "entropy", "sync_bytes")
# The learning run takes the recipe's 120 steps: its cosine decay reaches the floor at the last step, so a
# shorter run also learns less (60 steps ended at a 10-step mean of 0.79 on 2 threads).
LEARNING_STEPS = 120
# The shared short run (tests/e2e/conftest.py): a checkpoint every 2 steps (the resume test stops after the
# first) and an eval every 3 (the two-node test compares the last one); the seeded reference engine makes
# every step reproducible, so 6 steps check what a longer run would.
SHORT_RUN = ("train.steps=6", "train.checkpoint_every=2", "eval.every_steps=3")


def train(
    run_dir: Path, *overrides: str, timeout: float = 900, recipe: str = "tiny_arith"
) -> subprocess.CompletedProcess:
    argv = [
        *CLI,
        f"recipe={recipe}",
        f"run.dir={run_dir}",
        "run.progress=false",
        *port_overrides(),
        *overrides,
    ]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} exited {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result
