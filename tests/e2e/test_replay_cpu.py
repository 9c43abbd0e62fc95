"""`dsv4rl train` with routing and indexer replay: the planner starts the reference engine with
--enable-return-routed-experts / --enable-return-indexer-topk, the rollout asks for the choices, the
trainer replays them and metrics.jsonl reports the share that differed (float32 on both sides: ~none)."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_runs import train

from dsv4rl.metrics import read_metrics

pytestmark = pytest.mark.slow


def test_replays_reach_the_metrics(tmp_path: Path) -> None:
    run_dir = tmp_path / "replay"
    replays = ("algo.routing_replay=true", "algo.indexer_replay=true")
    train(run_dir, *replays, "train.steps=3", "algo.sampling.max_new_tokens=4")
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert [line["step"] for line in metrics] == [1, 2, 3]
    for line in metrics:
        assert line["routing_replay_decisions"] > 0 and line["indexer_replay_decisions"] > 0
        # the engine's cached decoding and the trainer's full forward, both float32, choose alike
        assert line["routing_replay_diff_fraction"] < 0.01
        assert line["indexer_replay_diff_fraction"] < 0.01
    engine_log = (run_dir / "logs" / "engine-0.log").read_text()
    assert "--enable-return-routed-experts --enable-return-indexer-topk" in engine_log


def test_replay_follows_each_token_across_weight_versions(tmp_path: Path) -> None:
    """Fully asynchronous (algo.max_staleness=2), pushes landing mid-response (continued in place): every
    token's recorded choices are the ones the engine made for it, whichever version it was sampled under.
    The learning rate is too small to move a float32 weight, so each version's weights are the same and
    any difference could only be a misplaced choice: none is."""
    run_dir = tmp_path / "replay_stream"
    replays = ("algo.routing_replay=true", "algo.indexer_replay=true")
    stream = ("algo.max_staleness=2", "sync.pause_mode=in_place", "optim.lr=1e-12", "eval.every_steps=0")
    train(
        run_dir,
        *replays,
        *stream,
        "train.steps=6",
        "algo.sampling.max_new_tokens=8",
        "algo.prompts_per_step=8",
    )
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert max(line["staleness/max"] for line in metrics) == 2
    assert any(line["partial/fraction"] > 0 for line in metrics)  # responses spanning two versions
    for line in metrics:
        assert line["routing_replay_decisions"] > 0 and line["indexer_replay_decisions"] > 0
        assert line["routing_replay_diff_fraction"] == 0 and line["indexer_replay_diff_fraction"] == 0
