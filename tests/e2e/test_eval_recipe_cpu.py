"""`dsv4rl eval checkpoint=RUN` of a run trained with its own `reward.fns`: no eval set named, so the run's
saved config decides: its eval set's problems, its sampling caps, and its reward functions grade (in the
reward worker pool, as in training). A function that gives every response 1.0 makes pass@1 = 1.0 where
the eval set's arith grader gives the (nearly untrained) tiny model about 0.05."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from free_ports import port_overrides

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train" / "fsdp"))
from fsdp_scenarios import make_batch  # noqa: E402

from dsv4rl.config.compose import compose  # noqa: E402
from dsv4rl.launcher.run import write_config  # noqa: E402
from dsv4rl.model.model_dir import materialize_model  # noqa: E402
from dsv4rl.train.checkpoint import checkpoint_dir  # noqa: E402
from dsv4rl.train.fsdp.backend import FSDPBackend  # noqa: E402

pytestmark = pytest.mark.slow

FUNCTIONS = Path(__file__).resolve().parents[1] / "eval" / "functions" / "eval_rewards.py"
OWN_REWARD = f"reward.fns=[{{name: always_one, target: '{FUNCTIONS}:always_one', weight: 1.0}}]"


def run_with_own_reward(run_dir: Path) -> None:
    """A run dir as `dsv4rl train recipe=tiny_arith 'reward.fns=[...]'` leaves it: config.yaml (with the
    run's reward.fns and a 2-token cap), model/, and a complete checkpoint of step 1."""
    cfg = compose("tiny_arith", [f"run.dir={run_dir}", OWN_REWARD, "algo.sampling.max_new_tokens=2"])
    run_dir.mkdir(parents=True)
    write_config(cfg, run_dir)
    materialize_model(cfg.model, str(run_dir / "model"), cfg.quant)
    store = dist.FileStore(str(run_dir.parent / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        backend = FSDPBackend(cfg, str(run_dir / "model"), torch.device("cpu"))
        backend.train_step(make_batch(8, seed=0), temperature=1.0)
        backend.save_checkpoint(str(checkpoint_dir(run_dir / "checkpoints", 1)), {"data": None})
    finally:
        dist.destroy_process_group()


def test_eval_of_a_run_scores_with_the_runs_own_reward_functions(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_with_own_reward(run_dir)
    small = ["eval.max_problems=4", "eval.samples_per_problem=2", "eval.k=[1,2]", "run.progress=false"]
    argv = [sys.executable, "-m", "dsv4rl.cli", "eval", f"checkpoint={run_dir}", *small, *port_overrides()]
    result = subprocess.run([*argv, "--json"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert (report["scored_by"], report["grader"]) == ("recipe", "reward.fns: always_one (weight 1)")
    assert report["pass@1"] == 1.0 and report["avg@2"] == 1.0 and report["problems"] == 4
    assert report["sampling"]["max_new_tokens"] == 2  # the run's cap, not the eval set's one token
    assert report["weights"]["kind"] == "checkpoint" and report["weights"]["step"] == 1
    assert report["reward_functions"]["reward/always_one/scored"] == 8
    saved = run_dir / "eval" / "tiny_arith-recipe" / "step_00000001" / "eval.json"
    assert json.loads(saved.read_text())["pass@1"] == 1.0
