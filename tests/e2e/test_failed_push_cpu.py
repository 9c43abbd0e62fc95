"""A weight push that fails on engines whose post-processing is not idempotent, end to end on tiny_arith:
the reference engine emulates SGLang's (`--emulate-non-idempotent-postprocess`), its update request fails
with step 2's tensors in flight (DSV4RL_INJECT_FAIL). With engine restarts on, the trainer asks for the
spent engine to be restarted, waits for it and pushes again: the run ends with the metrics of a run that
never failed. With `engine.max_restarts=0`, the launcher exits 76 with `FAILED_PUSH` and a requeue
counted in `REQUEUES`; the same command again (`resume=auto`, as the requeued job runs it) starts a fresh
engine, resumes from step 1's checkpoint and ends with the metrics of a run that never failed."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from cli_runs import CLI, NON_TIMING

from dsv4rl.faults.failed_push import FAILED_PUSH_EXIT
from dsv4rl.faults.inject import FAIL_ENV
from dsv4rl.metrics import read_metrics
from free_ports import port_overrides

pytestmark = pytest.mark.slow

STEPS = 2
SETTINGS = (
    f"train.steps={STEPS}", "train.checkpoint_every=1", "eval.every_steps=0",
    "algo.prompts_per_step=4", "algo.group_size=4",  # 16 samples a step: the launches dominate
    "engine.extra_args=[--emulate-non-idempotent-postprocess]",
)  # fmt: skip


def start(run_dir: Path, env: dict[str, str] | None = None, *overrides: str) -> subprocess.Popen:
    argv = [*CLI, "recipe=tiny_arith", f"run.dir={run_dir}", "run.progress=false", *SETTINGS, "resume=auto"]
    argv += overrides
    return subprocess.Popen([*argv, *port_overrides()], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **(env or {})})  # fmt: skip


def launch(run_dir: Path, env: dict[str, str] | None = None, *overrides: str) -> subprocess.CompletedProcess:
    process = start(run_dir, env, *overrides)
    try:
        stdout, stderr = process.communicate(timeout=600)
    finally:
        if process.poll() is None:
            process.kill()
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def launch_failing_beside_a_fault_free_run(
    run_dir: Path, straight: Path, *overrides: str
) -> subprocess.CompletedProcess:
    """The launch whose push of step STEPS fails, with a fault-free one in `straight` beside it (their
    start-ups overlap); the fault-free one must finish."""
    unfailed = start(straight)
    try:
        failing = launch(run_dir, {FAIL_ENV: f"engine-0:weight_broadcast:{STEPS}"}, *overrides)
        unfailed_out, _ = unfailed.communicate(timeout=600)
    finally:
        if unfailed.poll() is None:
            unfailed.kill()
    assert unfailed.returncode == 0, unfailed_out
    return failing


def assert_same_metrics(run_dir: Path, straight: Path) -> None:
    ours, theirs = (read_metrics(run / "metrics.jsonl") for run in (run_dir, straight))
    assert [line["step"] for line in ours] == list(range(1, STEPS + 1))
    for mine, unfailed in zip(ours, theirs, strict=True):
        assert {key: mine[key] for key in NON_TIMING} == {key: unfailed[key] for key in NON_TIMING}


def test_a_push_that_spends_the_engine_restarts_it_and_the_run_goes_on(tmp_path: Path) -> None:
    run_dir, straight = tmp_path / "replaced", tmp_path / "straight"
    replaced = launch_failing_beside_a_fault_free_run(run_dir, straight)
    out = replaced.stdout
    assert replaced.returncode == 0, out + replaced.stderr
    asked = f"! the trainer asks for engine-0 to be restarted (the push of step {STEPS} left them spent: "
    assert asked in out, out
    assert "(restart 1 of engine.max_restarts=3); the trainer waits for it" in out
    assert not (run_dir / "FAILED_PUSH").exists()
    assert (run_dir / "logs" / "engine-0.log").read_text().count("starting engine-0:") == 2
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert trainer_log.count("starting trainer:") == 1 and "resumed from" not in trainer_log
    assert f"pushing the weights of step {STEPS} again, to the engines that answer" in trainer_log
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert metrics[-1]["engine/restarts"] == 1
    assert "verify_probe_abs_diff" in metrics[-1]  # the restarted engine was probed at its rejoin
    assert_same_metrics(run_dir, straight)


def test_a_failed_push_exits_76_and_a_requeued_launch_resumes_to_unfailed_metrics(tmp_path: Path) -> None:
    run_dir, straight = tmp_path / "failed", tmp_path / "straight"
    failed = launch_failing_beside_a_fault_free_run(run_dir, straight, "engine.max_restarts=0")
    out = failed.stdout
    assert failed.returncode == FAILED_PUSH_EXIT, out + failed.stderr
    record = json.loads((run_dir / "FAILED_PUSH").read_text())
    checkpoint = str(run_dir / "checkpoints" / "step_00000001")
    assert (record["step"], record["checkpoint"]) == (STEPS, checkpoint)
    assert f"{FAIL_ENV}: engine-0 fails in weight_broadcast at step {STEPS}" in record["reason"]
    assert (record["requeue"], record["requeues"], record["max_requeues"]) == (True, 1, 3)
    assert json.loads((run_dir / "REQUEUES").read_text())["failed_push"] == 1
    crash = json.loads((run_dir / "logs" / "crash-trainer-rank0.json").read_text())  # the trainer's error
    assert "never push to these engines again" in crash["message"] and "root cause: trainer-rank0" in out
    assert f"requeue 1 of cluster.max_requeues=3 (exit {FAILED_PUSH_EXIT})" in out
    assert [m["step"] for m in read_metrics(run_dir / "metrics.jsonl")] == [1]

    resumed = launch(run_dir, None, "engine.max_restarts=0")  # what the requeued job runs: the same command
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resume=auto: continuing from {checkpoint}" in resumed.stdout
    assert not (run_dir / "FAILED_PUSH").exists()  # node 0's launcher cleared the earlier start's record
    starts = (run_dir / "logs" / "engine-0.log").read_text().count("starting engine-0:")
    assert starts == 2  # a fresh engine, the spent one stopped with the first launch

    assert_same_metrics(run_dir, straight)
