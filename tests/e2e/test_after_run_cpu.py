"""After a run, as a user goes on (`dsv4rl train` with trackers, resumed; `dsv4rl eval checkpoint=`;
`dsv4rl report`): TensorBoard's event files and the offline W&B run hold every step's metrics, equal to
metrics.jsonl, across a resume, with the run's outcome; the eval scores the exported checkpoint and says
so; the report lists it next to the periodic evals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from free_ports import port_overrides

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trackers"))
from tracker_readers import tensorboard_scalars, tensorboard_texts, wandb_history, wandb_summary  # noqa: E402

from dsv4rl.metrics import read_metrics  # noqa: E402
from dsv4rl.trackers.state import read_state  # noqa: E402

pytestmark = pytest.mark.slow

TRACKED = ("reward_mean", "grad_norm", "entropy", "eval/pass@1")


def cli(*argv: str, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "dsv4rl.cli", *argv]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    if result.returncode != 0:
        raise AssertionError(
            f"{' '.join(command)} exited {result.returncode}\n{result.stdout}\n{result.stderr}"
        )
    return result


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("after_run")
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", WANDB_SILENT="true")
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        env[name] = str(root / "wandb-home" / name.lower())
    env.pop("WANDB_API_KEY", None)
    run_dir = root / "run"
    common = [
        "train", "recipe=tiny_arith", f"run.dir={run_dir}", "run.progress=false",
        "logger=[jsonl,tensorboard,wandb]", "train.checkpoint_every=2", "eval.every_steps=2",
    ]  # fmt: skip
    first = cli(*common, "train.steps=3", *port_overrides(), env=env)
    state = read_state(run_dir)
    second = cli(*common, "train.steps=5", "resume=true", *port_overrides(), env=env)
    return {"run": run_dir, "env": env, "first": first, "second": second, "first_id": state.wandb_id}


def test_trackers_hold_every_step_across_a_resume(tracked_run):
    run_dir = tracked_run["run"]
    metrics = {line["step"]: line for line in read_metrics(run_dir / "metrics.jsonl")}
    assert sorted(metrics) == [1, 2, 3, 4, 5]  # step 3 was redone after resuming from step 2
    state = read_state(run_dir)
    assert state.wandb_id == tracked_run["first_id"] and state.wandb_mode == "offline"
    scalars = tensorboard_scalars(run_dir / "tensorboard")  # asserts no step twice (3 was purged)
    history = wandb_history(run_dir, state.wandb_id)
    for step, line in metrics.items():
        for key in TRACKED:
            if key in line:
                assert scalars[key][step] == line[key], (key, step)
                assert history[step][key] == line[key], (key, step)
    assert sorted(scalars["eval/pass@1"]) == [2, 4]
    assert tensorboard_texts(run_dir / "tensorboard")["outcome"][-1] == "finished"
    assert wandb_summary(run_dir, state.wandb_id)["outcome"] == "finished"
    assert f"wandb sync {run_dir}/wandb/offline-run-*-{state.wandb_id}*" in tracked_run["second"].stdout


def test_eval_of_a_checkpoint_scores_it_and_the_report_lists_it(tracked_run):
    run_dir, env = tracked_run["run"], tracked_run["env"]
    ports = port_overrides()
    result = cli(
        "eval", "tiny_arith", f"checkpoint={run_dir}", "eval.max_problems=4", *ports, "--json", env=env
    )
    report = json.loads(result.stdout)
    weights = report["weights"]
    assert weights["kind"] == "checkpoint" and weights["step"] == 5
    assert weights["checkpoint"] == str((run_dir / "checkpoints" / "step_00000005").resolve())
    assert (run_dir / "exports" / "step_00000005" / "dsv4rl-export.json").is_file()
    assert (run_dir / "eval" / "tiny_arith" / "step_00000005" / "eval.json").is_file()

    shown = cli("report", str(run_dir), env=env).stdout
    summary = (run_dir / "report" / "report.md").read_text()
    assert "| 5 | tiny_arith | dsv4rl eval | checkpoint step 5 |" in summary
    assert "| 4 | tiny_arith | training | training weights at step 4 |" in summary
    assert "eval reports" in shown
