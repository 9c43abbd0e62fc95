"""`dsv4rl prompts` of a recipe with tools: the prompts as training renders them (`build_multi_turn`'s
renderer), the tools listed; DeepSeek-V4's prompts carry the DSML "## Tools" block with the schema."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dataset_files import DATA, needs_data
from dsv4rl.cli import app

runner = CliRunner()


def prompts(*argv: str) -> dict:
    result = runner.invoke(app, ["prompts", *argv, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_tiny_tool_lists_its_tool_beside_the_plain_prompts() -> None:
    report = prompts("recipe=tiny_tool", "--n", "2")
    assert report["rollout_mode"] == "tools" and [t["name"] for t in report["tools"]] == ["lookup"]
    assert [p["text"] for p in report["prompts"]] == ["<bos>Q:", "<bos>Q:"]  # chat_format none: no block
    table = runner.invoke(app, ["prompts", "recipe=tiny_tool", "--n", "1"])
    assert table.exit_code == 0, table.output
    assert "rollout.mode=tools: 1 tool(s)" in table.output and "lookup:" in table.output


def test_a_single_turn_recipe_has_no_tools() -> None:
    report = prompts("recipe=tiny_arith", "--n", "1")
    assert report["rollout_mode"] == "single_turn" and report["tools"] == []
    table = runner.invoke(app, ["prompts", "recipe=tiny_arith", "--n", "1"])
    assert "tool(s)" not in table.output


@needs_data
def test_dapo_math_tir_prompts_carry_the_python_tool_block() -> None:
    sample = DATA / "dapo_math_17k_sample300.jsonl"
    common = (f"data.path={sample}", "data.holdout=0", "--n", "1")
    tir, plain = prompts("recipe=dapo_math_tir", *common), prompts("recipe=dapo_math", *common)
    (schema,) = tir["tools"]
    assert schema["name"] == "python" and "code" in schema["parameters"]["properties"]
    text = tir["prompts"][0]["text"]
    assert "## Tools" in text and "<｜DSML｜tool_calls>" in text and '"name": "python"' in text
    assert text.endswith("<｜Assistant｜><think>") and "## Tools" not in plain["prompts"][0]["text"]
    # the block counts against max_prompt_len: every prompt is longer by the same number of tokens
    extra = tir["prompts"][0]["tokens"] - plain["prompts"][0]["tokens"]
    assert 200 < extra < 600 and tir["lengths"]["mean"] == pytest.approx(plain["lengths"]["mean"] + extra)
