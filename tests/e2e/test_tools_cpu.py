"""`dsv4rl train recipe=tiny_tool` end to end: multi-turn rollouts with a tool call, the inserted tokens
masked, on the reference engine and both trainer backends, with replays, async rollout and colocated
engines. The learning run is the issue's acceptance: the tiny model cannot beat a guess without the tool
and learns to call it. A tool that raises on every call stops the run in its first step."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from cli_runs import CLI, train

from dsv4rl.metrics import read_metrics
from free_ports import port_overrides

pytestmark = pytest.mark.slow

TOOL_KEYS = ("tool/calls_mean", "tool/parse_errors", "tool/errors", "tool/timeouts", "tool/time_s",
             "tool/exceptions", "turns_mean", "finish/stop", "finish/length", "finish/max_turns",
             "masked_token_fraction", "generated_len_mean")  # fmt: skip


def train_tool(run_dir: Path, *overrides: str) -> list[dict]:
    train(run_dir, *overrides, recipe="tiny_tool")
    return read_metrics(run_dir / "metrics.jsonl")


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def test_tiny_tool_learns_to_call_its_tool(tmp_path: Path) -> None:
    metrics = train_tool(tmp_path / "run")
    rewards = [line["reward_mean"] for line in metrics]
    calls = [line["tool/calls_mean"] for line in metrics]
    assert all(key in line for line in metrics for key in TOOL_KEYS)
    assert mean(rewards[:10]) <= 0.3, rewards[:10]
    assert mean(rewards[-10:]) >= 0.85, rewards[-10:]
    assert mean(calls[:10]) < 0.5 and mean(calls[-10:]) >= 0.9, calls
    # the inserted "=d" is masked: a calling trajectory is "?", "=", "d", its answer (half inserted)
    assert metrics[-1]["masked_token_fraction"] > 0.4
    # fp32 on both sides: the engine's log-probs are the trainer's on every trained (mask 1) token
    assert max(line["logprob_abs_diff"] for line in metrics) < 1e-4
    records = [json.loads(line) for line in (tmp_path / "run" / "rollouts" / "step_00000080.jsonl").open()]
    called = [r for r in records if r.get("tool_calls")]
    assert called and all(r["finish_reason"] in ("stop", "length", "max_turns") for r in records)
    assert all([0, 1, 1.0] in r["loss_mask"] and [1, 3, 0.0] in r["loss_mask"] for r in called)


@pytest.mark.parametrize(
    "name, overrides",
    [
        (
            "megatron_replay",
            ("parallel.train.backend=megatron", "algo.routing_replay=true", "algo.indexer_replay=true"),
        ),
        ("async", ("algo.async_rollout=true", "algo.tis.enabled=true")),
        ("colocated", ("parallel.colocate=true",)),
    ],
)
def test_tools_mode_runs_on_every_loop(tmp_path: Path, name: str, overrides: tuple[str, ...]) -> None:
    metrics = train_tool(tmp_path / name, "train.steps=3", *overrides)
    assert [line["step"] for line in metrics] == [1, 2, 3]
    for line in metrics:
        assert line["tool/calls_mean"] > 0 and 0 < line["masked_token_fraction"] < 1
        assert line["tool/lookup/calls"] > 0 and line["tool/exceptions"] == line["tool/lookup/timeouts"] == 0
        if name != "async":  # async trains on samples of the previous weights: they differ by design
            assert line["logprob_abs_diff"] < 1e-4
    if "algo.routing_replay=true" in overrides:  # every position replays the turn that forwarded it first
        assert all(line["routing_replay_decisions"] > 0 for line in metrics)
        assert all(line["routing_replay_diff_fraction"] == 0.0 for line in metrics)
        assert all(line["indexer_replay_decisions"] > 0 for line in metrics)
        assert all(line["indexer_replay_diff_fraction"] < 0.01 for line in metrics)


def test_a_tool_that_always_raises_stops_the_run_naming_it(tmp_path: Path) -> None:
    """The tester's case: a tool whose every call raises. The run stops in its first step (not after
    three silent ones) with a non-zero exit, naming the tool, the exception and the fix; the trainer's
    log has the traceback."""
    run_dir = tmp_path / "run"
    broken = Path(__file__).with_name("broken_tool.py")
    argv = [*CLI, "recipe=tiny_tool", f"run.dir={run_dir}", "run.progress=false", *port_overrides(),
            f"rollout.tools=[{{target: '{broken}:lookup', timeout_s: 5}}]", "train.steps=3"]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "ToolFailureError: tool 'lookup'" in out, out
    assert "rollout.max_tool_error_fraction=0.05" in out and "fix the tool" in out, out
    assert "ConnectionError: the lookup service at 10.0.0.7:8080 is down" in out, out
    log = (run_dir / "logs" / "trainer.log").read_text()
    assert "tool 'lookup' raised ConnectionError: the lookup service at 10.0.0.7:8080 is down" in log
    assert f'File "{broken}", line 13, in lookup' in log  # the traceback, into the tool's own line
    assert not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text().strip()
