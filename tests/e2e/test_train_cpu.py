"""End-to-end runs of `dsv4rl train` on the tiny model: real engine, real trainer, real weight sync.

These start the CLI as a user would (a subprocess), so they cover the recipe, the supervisor, the
reference engine, torchrun + FSDP2, the broadcast weight sync, checkpoints and the metrics file.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_runs import CLI, LEARNING_STEPS, NON_TIMING, SHORT_RUN, train
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from dsv4rl.metrics import STEP_KEYS, read_metrics
from free_ports import port_overrides

pytestmark = pytest.mark.slow

# The variants (another backend, weight format, rollout mode) run 30 steps: their cosine decay over 30 steps
# takes the fp32 FSDP run from a 0.05 mean reward over steps 1-5 to 0.29 over the last ten; a variant
# that did not learn would stay near 0.05. The demo keeps the full curve.
SHORT_STEPS = 30
SHORT = f"train.steps={SHORT_STEPS}"


def assert_learns_in_a_short_run(rewards: list[float]) -> None:
    first, last = sum(rewards[:5]) / 5, sum(rewards[-10:]) / 10
    assert len(rewards) == SHORT_STEPS and last >= 0.15 and last >= 2.5 * first, rewards


ASYNC = ("algo.async_rollout=true", "algo.tis.enabled=true")


def model_weights(checkpoint: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    flat = tmp_path / f"{checkpoint.parent.parent.name}-{checkpoint.name}.pt"
    dcp_to_torch_save(str(checkpoint), str(flat))
    return torch.load(flat, weights_only=False)["model"]


def test_tiny_arith_learns(trained_arith: Path) -> None:
    metrics = read_metrics(trained_arith / "metrics.jsonl")
    rewards = [line["reward_mean"] for line in metrics]
    assert [line["step"] for line in metrics] == list(range(1, LEARNING_STEPS + 1))
    assert all(key in line for line in metrics for key in STEP_KEYS)
    assert sum(rewards[:5]) / 5 <= 0.3, rewards[:5]
    assert sum(rewards[-10:]) / 10 >= 0.8, rewards[-10:]
    # fp32 both sides, cached decoding equal to a full forward: the engine's log-probs are the trainer's.
    assert max(line["logprob_abs_diff"] for line in metrics) < 1e-4
    assert all(line["sync_bytes"] > 0 for line in metrics)
    # the first sync and every 10th are verified: the engine holds what was sent, and scores the probe
    # like the trainer; the others are not checked (and cost nothing)
    verified = [line for line in metrics if "verify_checksum_tensors" in line]
    assert [line["step"] for line in verified] == list(range(10, LEARNING_STEPS + 1, 10))
    assert all(line["verify_checksum_tensors"] > 150 for line in verified)
    assert max(line["verify_probe_abs_diff"] for line in verified) < 1e-4
    # the recipe's eval (all 16 problems x 8 samples) every 20 steps, on the weights of that step
    evals = [line for line in metrics if "eval/pass@1" in line]
    assert [line["step"] for line in evals] == list(range(20, LEARNING_STEPS + 1, 20))
    assert evals[-1]["eval/pass@1"] >= 0.7 and evals[-1]["eval/pass@1"] > evals[0]["eval/pass@1"]
    assert all(line["eval/pass@8"] >= line["eval/pass@1"] for line in evals)
    assert (trained_arith / "eval" / f"step_{LEARNING_STEPS:08d}.json").is_file()


def test_report_of_the_demo_run(trained_arith: Path) -> None:
    """`dsv4rl report` on the demo's run dir: every plot, eval scores included, and the summary."""
    argv = [sys.executable, "-m", "dsv4rl.cli", "report", str(trained_arith)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    out = trained_arith / "report"
    names = ("reward", "response_length", "logprob_diff", "kl_entropy", "step_time", "sync", "eval")
    for name in names:
        png = (out / f"{name}.png").read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 8000, name
    summary = (out / "report.md").read_text()
    assert "finished" in summary and "eval/pass@1" in summary


def test_eval_of_the_tiny_model_through_the_reference_engine(tmp_path: Path) -> None:
    """`dsv4rl eval tiny_arith --json`: the supervisor starts the engine, 16 problems x 8 samples are
    sampled and graded, and the report's numbers agree with its own per-problem table."""
    argv = [sys.executable, "-m", "dsv4rl.cli", "eval", "tiny_arith", f"run.dir={tmp_path}",
            "run.progress=false", *port_overrides(), "--json"]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    rows = report["per_problem"]
    assert (report["problems"], report["samples_per_problem"], len(rows)) == (16, 8, 16)
    assert report["pass@1"] == pytest.approx(sum(row["correct"] for row in rows) / 128)
    assert report["pass@8"] == pytest.approx(sum(row["correct"] > 0 for row in rows) / 16)
    assert report["response_len_mean"] == 1.0 and report["engines"] and report["seconds"]["generate"] > 0
    assert (tmp_path / "eval" / "tiny_arith" / "eval.json").is_file()
    engine_log = (tmp_path / "eval" / "tiny_arith" / "logs" / "engine-0.log").read_text()
    assert "Freezing GC in the engine process" in engine_log  # engine.freeze_gc holds for eval too


def test_released_weight_format_with_async_rollouts_learns(tmp_path: Path) -> None:
    """FP8 linears and MXFP4 experts on the wire, into an engine started from such a checkpoint, and one
    step off-policy: each step's batch was generated while the previous step trained (weights one version
    old, corrected by TIS). The run still learns. The engine binds 0.0.0.0, as on a cluster: it answers only
    the run's keys."""
    run_dir = tmp_path / "fp8_mxfp4_async"
    train(run_dir, SHORT, "quant=fp8_mxfp4", *ASYNC, "engine.host=0.0.0.0")
    key_file = run_dir / "engine-keys.yaml"
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert f"--config {key_file}" in (run_dir / "logs" / "engine-0.log").read_text()
    metrics = read_metrics(run_dir / "metrics.jsonl")
    rewards = [line["reward_mean"] for line in metrics]
    assert_learns_in_a_short_run(rewards)
    # the engine really holds quantized weights: right after a sync (same weights on both sides) its probe
    # log-probs differ from the fp32 trainer's, a little; the rollouts' difference also holds one version of
    # staleness (each batch was sampled before the last update), so it is only bounded
    probes = [line["verify_probe_abs_diff"] for line in metrics if "verify_probe_abs_diff" in line]
    assert 1e-4 < max(probes) < 0.2, probes
    assert max(line["logprob_abs_diff"] for line in metrics) < 1.0
    assert all(0.0 <= line["tis_clip_fraction"] <= 1.0 for line in metrics)
    verified = [line for line in metrics if "verify_checksum_tensors" in line]  # every 10th step
    assert len(verified) == SHORT_STEPS // 10
    assert all(line["verify_checksum_tensors"] == 252 for line in verified)  # + scales
    stored = json.loads((run_dir / "model" / "config.json").read_text())["quantization_config"]
    assert stored["weight_block_size"] == [128, 128] and stored["scale_fmt"] == "ue8m0"
    assert metrics[0]["staleness/mean"] == 0  # the first batch comes from the starting weights
    assert all(line["staleness/mean"] == line["staleness/max"] == 1 for line in metrics[1:])
    overlapped = [line["async_overlap_s"] for line in metrics[:-1]]
    assert all(seconds > 0 for seconds in overlapped)  # the next rollout ran while each step trained


def test_same_seed_same_curve(short_arith: Path, tmp_path: Path) -> None:
    """Two runs with the same seed give the same rewards, gradients and entropies, step by step (the second
    is the session's short run)."""
    train(tmp_path / "again", *SHORT_RUN)
    first, second = (read_metrics(run_dir / "metrics.jsonl") for run_dir in (tmp_path / "again", short_arith))
    assert len(first) == len(second) == 6
    for ours, theirs in zip(first, second, strict=True):
        assert {key: ours[key] for key in NON_TIMING} == {key: theirs[key] for key in NON_TIMING}
    assert len({line["reward_mean"] for line in first}) > 1  # a curve, not a constant


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_resume_reaches_the_same_weights(short_arith: Path, tmp_path: Path, mode: str) -> None:
    """Stop a run (Ctrl-C) once it has a checkpoint, resume it, compare with an uninterrupted run (sync: the
    session's short run). Async: the batch generated before the stop (part of the checkpoint) is the one the
    resumed run trains first."""
    stopped = tmp_path / "stopped"
    if mode == "async":
        straight, settings = tmp_path / "straight", ("train.steps=6", "train.checkpoint_every=2", *ASYNC)
        train(straight, *settings)
    else:
        straight, settings = short_arith, SHORT_RUN

    argv = [*CLI, "recipe=tiny_arith", f"run.dir={stopped}", "run.progress=false", *settings]
    process = subprocess.Popen(
        [*argv, *port_overrides()], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    first = stopped / "checkpoints" / "step_00000002" / "trainer_state.pt"
    try:
        deadline = time.monotonic() + 300
        while not first.exists():
            assert process.poll() is None, process.stdout.read()
            assert time.monotonic() < deadline, "no checkpoint in 300 s"
            time.sleep(0.1)
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130
    interrupted_at = len(read_metrics(stopped / "metrics.jsonl"))
    assert interrupted_at < 6, "the run finished before it was stopped"

    train(stopped, *settings, "resume=true")
    assert "resumed from" in (stopped / "logs" / "trainer.log").read_text()
    ours = model_weights(stopped / "checkpoints" / "step_00000006", tmp_path)
    theirs = model_weights(straight / "checkpoints" / "step_00000006", tmp_path)
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    # The engine held the resumed weights before its first rollout: later steps sampled the same responses.
    resumed, uninterrupted = (read_metrics(run / "metrics.jsonl") for run in (stopped, straight))
    assert [line["step"] for line in resumed] == [1, 2, 3, 4, 5, 6]
    for ours_line, theirs_line in zip(resumed, uninterrupted, strict=True):
        assert {key: ours_line[key] for key in NON_TIMING} == {key: theirs_line[key] for key in NON_TIMING}


def test_two_trainer_ranks(tmp_path: Path) -> None:
    """FSDP2 over 2 gloo ranks: both train, rank 0 drives the engine and the sync.

    Multi-token answers here, so the engine's cached decoding is compared with the trainer's full forward."""
    run_dir = tmp_path / "fsdp2"
    train(run_dir, "parallel=cpu_fsdp2", "train.steps=3", "algo.sampling.max_new_tokens=4")
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert [line["step"] for line in metrics] == [1, 2, 3]
    assert max(line["logprob_abs_diff"] for line in metrics) < 1e-4
    assert all(line["response_len_mean"] > 1 for line in metrics)
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert "rank1" in trainer_log
    # engine.freeze_gc (on by default): the trainer asked the engine, and both froze their own objects
    assert "froze the garbage collector of 1 engine(s)" in trainer_log
    assert trainer_log.count("objects out of the garbage collector") == 2  # each rank
    assert "Freezing GC in the engine process" in (run_dir / "logs" / "engine-0.log").read_text()


def test_megatron_backend_learns(tmp_path: Path) -> None:
    """The same recipe on the Megatron backend (megatron-core through the CPU shims) learns like FSDP."""
    run_dir = tmp_path / "megatron"
    train(run_dir, "parallel.train.backend=megatron", SHORT)
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert_learns_in_a_short_run([line["reward_mean"] for line in metrics])
    assert (
        max(line["logprob_abs_diff"] for line in metrics) < 1e-4
    )  # the exported weights are the trained ones
    assert (
        run_dir / "checkpoints" / f"step_{SHORT_STEPS:08d}" / "metadata.json"
    ).exists()  # megatron's checkpoint


def test_megatron_two_pipeline_stages(tmp_path: Path) -> None:
    """PP=2 on 2 processes (one layer on the last stage): the schedule trains, each stage's source rank
    sends its own stage over its own group, every tensor reaches the engine (checksums), and the engine's
    log-probs stay the trainer's."""
    run_dir = tmp_path / "megatron_pp2"
    train(
        run_dir,
        "parallel.train.backend=megatron",
        "parallel.train.nproc_per_node=2",
        "parallel.train.pipeline_parallel=2",
        "parallel.train.last_stage_layers=1",
        "train.steps=4",
        "train.checkpoint_every=2",
        "sync.verify.every_steps=1",
    )
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert [line["step"] for line in metrics] == [1, 2, 3, 4]
    assert max(line["logprob_abs_diff"] for line in metrics) < 1e-4
    assert all(line["verify_checksum_tensors"] > 150 for line in metrics)
    assert all(line["sync_sources"] == 2 for line in metrics)
    assert metrics[-1]["reward_mean"] > metrics[0]["reward_mean"]
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert "weights 4 pushed from 2 stages" in trainer_log


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_engine_killed_mid_run_stops_everything(tmp_path: Path) -> None:
    run_dir = tmp_path / "killed"
    argv = [*CLI, "recipe=tiny_arith", f"run.dir={run_dir}", "run.progress=false", "train.steps=200"]
    process = subprocess.Popen(
        [*argv, *port_overrides()], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text().strip()):
            assert process.poll() is None, process.stdout.read()
            assert time.monotonic() < deadline, "no step finished in 300 s"
            time.sleep(0.5)
        children = descendants(process.pid)
        engine = [pid for pid in children if "dsv4rl.engine" in Path(f"/proc/{pid}/cmdline").read_text()]
        assert len(engine) == 1, children
        os.kill(engine[0], signal.SIGKILL)
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode != 0
    assert "engine-0" in output and "ready to roll" in output  # names the child and shows its last log lines
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in children if alive(pid)], "orphan processes left behind"
    assert len(json.loads(metrics.read_text().splitlines()[0])) >= len(STEP_KEYS)
