"""Fully asynchronous rollouts (`algo.max_staleness=2`): the reference engine generates throughout, weights
are pushed into it with requests in flight (paused in place), and each step trains on finished groups at
most two versions old."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_runs import LEARNING_STEPS, train

from dsv4rl.metrics import read_metrics

pytestmark = pytest.mark.slow

STREAM = ("algo.max_staleness=2", "sync.pause_mode=in_place")
STREAM_KEYS = ("staleness/mean", "staleness/max", "partial/fraction", "oversample/kept_fraction",
               "rollout/engine_idle_fraction", "staleness/dropped_groups")  # fmt: skip


def check_records(run_dir: Path, bound: int) -> int:
    """Every saved sample's per-token versions cover its response, are no older than `bound` versions
    behind the weights its step trained, and never run backwards; returns how many samples span several."""
    spanning = 0
    files = sorted((run_dir / "rollouts").glob("step_*.jsonl"))
    assert files
    for path in files:
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if not record["trained"]:
                continue
            spans, step = record["versions"], record["step"]
            assert spans[0][1] == 0 and spans[-1][2] == len(record["response_ids"]), record
            assert all(a[2] == b[1] for a, b in zip(spans, spans[1:], strict=False)), spans
            versions = [int(version) for version, _, _ in spans]
            assert versions == sorted(versions) and step - 1 - versions[0] <= bound, (step, spans)
            assert record["weight_version"] == spans[0][0]
            spanning += len(spans) > 1
    return spanning


def test_fully_async_tiny_arith_learns_within_its_staleness_bound(tmp_path: Path) -> None:
    """The issue's command: `dsv4rl train recipe=tiny_arith algo.max_staleness=2 sync.pause_mode=in_place`
    (TIS unset: on for an off-policy run) learns as the demo does."""
    run_dir = tmp_path / "stream"
    train(run_dir, *STREAM, "eval.every_steps=0")
    metrics = read_metrics(run_dir / "metrics.jsonl")
    rewards = [line["reward_mean"] for line in metrics]
    assert [line["step"] for line in metrics] == list(range(1, LEARNING_STEPS + 1))
    assert sum(rewards[-10:]) / 10 >= 0.9, rewards[-10:]
    assert all(key in line for line in metrics for key in STREAM_KEYS)
    assert all(line["staleness/max"] <= 2 for line in metrics)
    assert metrics[0]["staleness/max"] == 0  # the first batch comes from the starting weights
    # the engines ran ahead of the trainer: most batches were sampled two versions back
    assert sum(line["staleness/max"] == 2 for line in metrics) >= LEARNING_STEPS // 2
    assert all("tis_clip_fraction" in line for line in metrics)  # the correction is on
    check_records(run_dir, bound=2)


def test_an_oversampled_filtered_stream_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    """Eight-token responses, so pushes land mid-response (continued in place); DAPO's filter over 1.5x
    the groups; a checkpoint keeps the finished groups not yet trained and the problems in flight, and a
    resumed run goes on from there."""
    run_dir = tmp_path / "stream_resume"
    longer = (*STREAM, "algo.sampling.max_new_tokens=8", "algo.prompts_per_step=8", "eval.every_steps=0",
              "algo.oversample.factor=1.5", "algo.oversample.filter=builtin:nonzero_std",
              "train.checkpoint_every=2", "run.save_rollouts=1")  # fmt: skip
    train(run_dir, *longer, "train.steps=4")
    train(run_dir, *longer, "train.steps=8", "resume=true")
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert [line["step"] for line in metrics] == list(range(1, 9))
    assert all(line["staleness/max"] <= 2 for line in metrics)
    # the filter threw groups away (most of the untrained model's groups score all 0) and batches stayed full
    assert min(line["oversample/kept_fraction"] for line in metrics) < 1
    assert all(line["samples_trained"] == 8 * 16 for line in metrics)
    spanning = check_records(run_dir, bound=2)
    partial = sum(line["partial/fraction"] * line["samples_trained"] for line in metrics)
    assert round(partial) == spanning  # the metric counts the samples the records show spanning versions
    trained: dict[tuple[int, int], set[float]] = {}
    for path in (run_dir / "rollouts").glob("step_*.jsonl"):
        for record in map(json.loads, path.read_text().splitlines()):
            if record["trained"]:
                trained.setdefault((record["step"], record["group"]), set()).add(record["reward"])
    assert trained and all(len(rewards) > 1 for rewards in trained.values())  # only groups that differ
