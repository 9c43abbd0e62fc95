"""Your own task, end to end on the tiny model: reward functions from the recipe, faults that must neither
stall nor crash a run, rollout records, and the examples a user copies (a code task, a remote reward
service, a judge model), each run as `dsv4rl train` runs them. Short runs: the mechanics, not the learning
(docs/tasks.md has the full runs and their numbers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
from cli_runs import train

from dsv4rl.metrics import read_metrics
from free_ports import free_port, port_overrides
from marked_processes import running_with

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
USER = ROOT / "tests" / "reward" / "user_fns.py"
SHORT = ("eval=none", "train.checkpoint_every=0")


def test_user_functions_faults_and_rollout_records(tmp_path: Path) -> None:
    """`ok` re-implements the arithmetic check: its score equals the builtin grader's on the same samples,
    every step. Beside it, logged only (weight 0): a function that sleeps past its timeout on some samples,
    one that raises on some, one that returns None, a group function, a format check and an async one; all
    under on_error=exclude, the run goes on and the counts are in metrics.jsonl."""
    fns = ", ".join([
        f"{{name: ok, target: {EXAMPLES}/arith_reward.py:score}}",
        "{name: arith, target: 'builtin:arith', weight: 0}",
        f"{{name: slow, target: {USER}:sleepy, weight: 0, timeout_s: 0.5, on_error: exclude, "
        "kwargs: {delay: 5, every: 128}}",
        f"{{name: boom, target: {USER}:raises, weight: 0, on_error: exclude, kwargs: {{every: 64}}}}",
        f"{{name: none, target: {USER}:nothing, weight: 0}}",
        f"{{name: agree, target: {EXAMPLES}/group_reward.py:agreement, weight: 0, group: true}}",
        f"{{name: format, target: {EXAMPLES}/format_length.py:format_reward, weight: 0, "
        "kwargs: {bare_integer: true}}",
        f"{{name: aok, target: {USER}:async_ok, weight: 0}}",
    ])  # fmt: skip
    run = tmp_path / "run"
    steps = 3
    train(
        run,
        f"reward.fns=[{fns}]",
        "reward.num_workers=2",
        "run.save_rollouts=1",
        f"train.steps={steps}",
        *SHORT,
    )
    metrics = read_metrics(run / "metrics.jsonl")
    assert [line["step"] for line in metrics] == list(range(1, steps + 1))
    for line in metrics:
        assert line["reward/ok/score"] == line["reward/arith/score"] == line["reward_mean"]
        assert line["reward/ok/scored"] == 512 and line["reward_excluded"] == 0
        assert line["reward/slow/timeouts"] == 4 and line["reward/slow/scored"] == 508  # every 128th sample
        assert line["reward/boom/errors"] == 8 and line["reward/none/none"] == 512
        assert line["reward/agree/scored"] == 512 and 0.0 <= line["reward/agree/share"] <= 1.0
        assert line["reward/aok/score"] == 1.0 and "reward/format/score" in line
        assert (
            line["grader_timeouts"] == 4 and line["grader_errors"] == 8 and line["reward_pool_restarts"] == 4
        )
    argv = [sys.executable, "-m", "dsv4rl.cli", "rollouts", str(run), "--step", "2", "--json"]
    shown = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    data = json.loads(shown.stdout)
    assert data["step"] == 2 and len(data["samples"]) == 512
    sample = data["samples"][0]
    for key in ("prompt", "response", "response_ids", "logprobs", "finish_reason", "rewards", "reward",
                "advantage", "weight_version"):  # fmt: skip
        assert key in sample, key
    assert sample["rewards"]["slow"]["status"] == "timeout" and sample["weight_version"] == "1"
    assert sample["rewards"]["ok"]["score"] == sample["reward"]
    assert len(sample["logprobs"]) == len(sample["response_ids"]) == 1


def test_a_reward_that_always_hangs_stops_the_first_step_and_leaves_no_process(tmp_path: Path) -> None:
    """The hostile case of issue 37: the only reward function starts three processes (a child, a child in a
    session of its own, a double-forked daemon), then hangs; timeout_s 1, on_error zero, one worker. The
    run stops in step 1 once 4 of its 64 calls timed out (more than reward.max_timeout_fraction=0.05),
    naming the function and its timeout in `dsv4rl train`'s root cause, the trainer's log and its crash
    report; never more processes of the function live than one call's three (the killed worker's go with
    it), and none after the run. Before: step 1 took a timeout per sample and trained on zeros."""
    marker_dir = tmp_path / f"dsv4rl-e2e-{uuid.uuid4().hex[:12]}"
    marker_dir.mkdir()
    run = tmp_path / "run"
    fns = (
        f"[{{name: hang, target: {USER}:spawns, timeout_s: 1, on_error: zero, "
        f"kwargs: {{marker_dir: {marker_dir}}}}}]"
    )
    argv = [sys.executable, "-m", "dsv4rl.cli", "train", "recipe=tiny_arith", f"run.dir={run}",
            "run.progress=false", *port_overrides(), f"reward.fns={fns}", "train.steps=3",
            "algo.prompts_per_step=16", "algo.group_size=4", *SHORT]  # fmt: skip
    console = tmp_path / "console.txt"
    most = 0  # marked processes alive at once, polled while the run goes on
    with console.open("w") as sink:
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        while proc.poll() is None:
            most = max(most, len(running_with(marker_dir.name)))
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in running_with(marker_dir.name):
            os.kill(pid, 9)
    out = console.read_text()
    assert proc.returncode == 1, out
    named = (
        f"RewardError: reward function 'hang' ({USER}:spawns): 4 of the 64 samples of step 1 timed out (no "
        "result within timeout_s=1), more than reward.max_timeout_fraction=0.05 allows (3)"
    )
    assert f"root cause: trainer-rank0: dsv4rl.reward.results.{named}" in out, out
    crash = json.loads((run / "logs" / "crash-trainer-rank0.json").read_text())
    assert named.split("RewardError: ")[1] in crash["message"] and "reward.timeout_s" in crash["message"]
    assert named in (run / "logs" / "trainer.log").read_text()
    assert not (run / "metrics.jsonl").exists()  # no step trained
    assert len(list(marker_dir.glob("daemon-*"))) >= 1  # the calls started their processes
    assert most <= 3  # one call's at a time: a killed worker's went with it
    assert running_with(marker_dir.name) == []


def train_recipe(recipe: Path, run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    """`dsv4rl train recipe=<file>` as a user runs an example (from the checkout, on free ports)."""
    argv = [sys.executable, "-m", "dsv4rl.cli", "train", f"recipe={recipe}", f"run.dir={run_dir}",
            "run.progress=false", *port_overrides(), *overrides]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=ROOT)
    if result.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} exited {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result


def test_code_task_example(tmp_path: Path) -> None:
    """examples/code_tests.yaml: each row's unit tests (columns of its own) run on the response in a
    subprocess; the tiny model's one digit is the body of `solution()`."""
    run = tmp_path / "run"
    batch = ("algo.prompts_per_step=8", "algo.group_size=8")  # 64 subprocesses a step
    train_recipe(EXAMPLES / "code_tests.yaml", run, "train.steps=3", "run.save_rollouts=3", *batch)
    metrics = read_metrics(run / "metrics.jsonl")
    assert len(metrics) == 3
    for line in metrics:
        assert line["reward/tests/scored"] == 64 and line["reward/tests/errors"] == 0
        assert (
            0.0 < line["reward/tests/compiled"] <= 1.0 and line["reward_mean"] == line["reward/tests/score"]
        )
    records = [json.loads(x) for x in (run / "rollouts" / "step_00000003.jsonl").read_text().splitlines()]
    passing = [r for r in records if r["rewards"]["tests"]["score"] == 1.0]
    assert all(r["response"].strip() == r["ground_truth"] for r in passing)


@pytest.fixture
def reward_service():  # noqa: ANN201
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(EXAMPLES / "reward_server.py"), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            assert proc.poll() is None and time.monotonic() < deadline, "the reward service did not start"
            time.sleep(0.2)
    yield f"{url}/score"
    proc.kill()
    proc.wait(timeout=10)


def test_remote_reward_example(tmp_path: Path, reward_service: str) -> None:
    """examples/remote.yaml against examples/reward_server.py on loopback: the service's scores are the
    rewards, its second number is logged."""
    run = tmp_path / "run"
    train_recipe(EXAMPLES / "remote.yaml", run, f"reward.remote.url={reward_service}", "train.steps=2")
    for line in read_metrics(run / "metrics.jsonl"):
        assert line["reward/remote/scored"] == 512 and line["reward/remote/errors"] == 0
        assert line["reward_mean"] == line["reward/remote/score"] and line["reward/remote/answer_chars"] > 0


def test_judge_example(tmp_path: Path) -> None:
    """examples/judge.yaml: the run's own reference engine answers /v1/chat/completions; the judge's parsed
    score is part of the reward, an unparseable reply is excluded (on_error), counted."""
    run = tmp_path / "run"
    train_recipe(EXAMPLES / "judge.yaml", run, "train.steps=2")
    for line in read_metrics(run / "metrics.jsonl"):
        judged = line["reward/judge/scored"]
        assert judged + line["reward/judge/errors"] == 512 and judged > 0
        assert 0.0 <= line["reward/judge/score"] <= 0.9 and line["reward/correct/scored"] == 512
        assert line["reward/judge/timeouts"] == 0


def test_a_constant_reward_is_called_out_as_not_learning_within_ten_steps(tmp_path: Path) -> None:
    """Every group flat (a reward that never varies): the console names it by step 5, once, with causes."""
    run = tmp_path / "run"
    fns = f"[{{name: same, target: {USER}:constant, kwargs: {{value: 0.0}}}}]"
    small = ("algo.prompts_per_step=4", "algo.group_size=4", "train.steps=6")
    result = train(run, f"reward.fns={fns}", *small, *SHORT)
    metrics = read_metrics(run / "metrics.jsonl")
    assert [m["reward/zero_std_fraction"] for m in metrics] == [1.0] * 6
    said = "not learning: every group's rewards have been equal for 5 steps (to step 5;"
    assert result.stdout.count(said) == 1, result.stdout
    assert "every response scores 0: check the reward functions" in result.stdout
