"""recipes/dapo_math_tir.yaml: dapo_math with the python tool. It composes, validates (the tool is built),
keeps dapo_math's layout and token budget (so its memory plan is dapo_math's), and plans all four nodes."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dsv4rl.checks.validate import validate
from dsv4rl.cli import app
from dsv4rl.config.choices import ChatFormat, RolloutMode, TruncateSide
from dsv4rl.config.compose import compose
from dsv4rl.config.schema import Config

ADDRS = ["cluster.node_addrs=[gpu-a01,gpu-a02,gpu-a03,gpu-a04]", "cluster.master_addr=gpu-a01"]
runner = CliRunner()


@pytest.fixture(scope="module")
def tir() -> Config:
    return compose("dapo_math_tir", ADDRS)


def test_tir_is_dapo_math_with_the_python_tool(tir: Config) -> None:
    validate(tir, check_paths=False)  # the rollout rules and the tool's target (built once, probed)
    dapo = compose("dapo_math", ADDRS)
    r = tir.rollout
    assert r.mode == RolloutMode.tools and [t.target for t in r.tools] == ["builtin:python"]
    assert r.tools[0].kwargs == {
        "isolation": "auto",
        "timeout_s": 10.0,
        "memory_mb": 2048,
        "max_processes": 8,
    }
    assert r.tools[0].timeout_s > 10.0
    assert (r.max_turns, r.max_tool_calls, r.max_tool_output_tokens) == (8, 8, 1024)
    assert r.truncate_side == TruncateSide.middle and r.max_concurrent_tools >= 1
    # the whole trajectory fits dapo_math's response cap: the sequence budget (and memory) is unchanged
    assert r.max_total_tokens == dapo.algo.sampling.max_new_tokens == 4096
    assert r.max_new_tokens_per_turn <= r.max_total_tokens
    assert (tir.data.chat_format, tir.data.thinking) == (ChatFormat.deepseek_v4, True)
    for section in ("model", "parallel", "algo", "quant", "comm", "cluster", "eval", "optim", "sync"):
        assert getattr(tir, section) == getattr(dapo, section), section
    assert tir.run.dir == "runs/dapo_math_tir" and tir.recipe == "dapo_math_tir"


def test_train_cfg_prints_the_rollout_and_starts_nothing() -> None:
    result = runner.invoke(app, ["train", "recipe=dapo_math_tir", "--cfg"])
    assert result.exit_code == 0, result.output
    assert "mode: tools" in result.output and "target: builtin:python" in result.output


def test_plan_all_nodes_matches_dapo_math() -> None:
    """`dsv4rl plan recipe=dapo_math_tir --all-nodes --json`: dapo_math's nodes, roles and memory."""

    def plan(recipe: str) -> dict:
        argv = ["plan", f"recipe={recipe}", "--all-nodes", "--json", "--skip-engine-check", *ADDRS]
        result = runner.invoke(app, argv)
        assert result.exit_code == 0, result.output
        return json.loads(result.output)

    tir, dapo = plan("dapo_math_tir"), plan("dapo_math")
    assert tir["memory"]["fits"] is True and tir["memory"] == dapo["memory"]
    assert [n["roles"] for n in tir["nodes"]] == [n["roles"] for n in dapo["nodes"]]
    assert tir["run_dir"].endswith("runs/dapo_math_tir")
    assert tir["rollout"]["mode"] == "tools" and dapo["rollout"]["mode"] == "single_turn"
    assert [tool["target"] for tool in tir["rollout"]["tools"]] == ["builtin:python"]
    assert tir["rollout"]["max_tool_error_fraction"] == 0.05
    # the isolation this node gives the tool, every guarantee with its layer, and the bound per call
    (python,) = tir["rollout"]["tools"]
    assert python["isolation"] in ("namespaces", "landlock")
    assert set(python["layers"]) == {"files", "network", "processes", "privileges", "cleanup", "memory"}
    assert python["memory_mb"] == 2048 and python["max_processes"] in (1, 8)
    assert python["node_memory_mb"] == 2048 * tir["rollout"]["max_concurrent_tools"]
    # the tool block makes prompts longer: the step-time estimate counts it
    assert (
        tir["step_time"]["assumptions"]["mean_prompt_tokens"]
        > dapo["step_time"]["assumptions"]["mean_prompt_tokens"]
    )
