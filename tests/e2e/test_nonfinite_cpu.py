"""The non-finite guard on a real run of the tiny model (DSV4RL_INJECT_NONFINITE): a NaN advantage at step
2 is skipped and counted in metrics.jsonl, a NaN weight after step 3 stops the run at the weight sync
naming the weight, before anything is pushed or checkpointed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv4rl.faults.nonfinite import NONFINITE_ENV
from dsv4rl.metrics import read_metrics
from dsv4rl.train.checkpoint_dirs import FINITE, TRAINER_STATE
from free_ports import port_overrides

pytestmark = pytest.mark.slow


def test_a_nonfinite_step_is_skipped_and_nonfinite_weights_stop_the_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    argv = [
        sys.executable, "-m", "dsv4rl.cli", "train", "recipe=tiny_arith", f"run.dir={run_dir}",
        "run.progress=false", "train.steps=4", "train.checkpoint_every=1", "train.keep_checkpoints=5",
        "eval.every_steps=0", "algo.prompts_per_step=4", "algo.group_size=4",
        *port_overrides(),
    ]  # fmt: skip
    env = {**os.environ, NONFINITE_ENV: "advantages:2,weights:3"}
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "NonFiniteError" in out and "step 3, phase sync" in out, out
    assert "the first non-finite tensor is weight model.embed_tokens.weight (NaN in 1 of" in out, out
    assert "nothing was pushed to the engines" in out, out

    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert [line["step"] for line in metrics] == [1, 2]  # step 3 stopped at its sync
    assert [line["nonfinite_steps"] for line in metrics] == [0, 1]
    assert metrics[1]["loss"] is None and metrics[1]["grad_norm"] is None  # NaN, written as null
    checkpoints = sorted(path.name for path in (run_dir / "checkpoints").iterdir())
    assert checkpoints == ["step_00000001", "step_00000002"]  # never step 3's NaN weights
    for name in checkpoints:
        assert torch.load(run_dir / "checkpoints" / name / TRAINER_STATE, weights_only=True)[FINITE] is True
    log = (run_dir / "logs" / "trainer.log").read_text()
    assert "step 2, update 1 of 1: the first non-finite tensor is loss; optimizer step skipped" in log
