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
