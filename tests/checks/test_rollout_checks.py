"""`rollout` checked before anything starts (`dsv4rl.checks.rollout`): the mode against its tools or
environment, the budgets, the format; the tools and the environment imported and built on this machine."""

from __future__ import annotations

from pathlib import Path

from recipe_problems import recipe_problems


def problems(recipe: str, *overrides: str, check_paths: bool = True) -> list[str]:
    return recipe_problems(recipe, *overrides, check_paths=check_paths)


def test_the_tool_recipes_validate() -> None:
    assert problems("tiny_tool") == []


def test_a_mode_without_its_tools_or_environment() -> None:
    assert any(
        "rollout.mode=tools needs at least one tool" in p for p in problems("tiny_tool", "rollout.tools=[]")
    )
    found = problems("tiny_arith", "rollout.mode=env")
    assert any("rollout.mode=env needs rollout.env=" in p for p in found), found


def test_tools_set_but_a_single_turn_mode() -> None:
    found = problems("tiny_tool", "rollout.mode=single_turn")
    assert any("rollout.mode=single_turn runs neither" in p for p in found), found


def test_budgets_that_cannot_hold() -> None:
    found = problems(
        "tiny_tool", "rollout.max_new_tokens_per_turn=16", "rollout.max_turns=0", "rollout.max_tool_calls=0"
    )
    assert any("rollout.max_total_tokens=4" in p and "max_new_tokens_per_turn" in p for p in found), found
    assert any("rollout.max_turns must be >= 1" in p for p in found), found
    assert any("rollout.max_tool_calls must be >= 1" in p for p in found), found


def test_dsml_calls_refused_on_the_character_tokenizer() -> None:
    found = problems("tiny_tool", "data.chat_format=deepseek_v4")
    assert any("cannot spell" in p and "chat_format=none" in p for p in found), found


def test_tools_and_environments_are_built_at_validation(tmp_path: Path) -> None:
    found = problems("tiny_tool", "rollout.tools=[{target: 'builtin:no_such_tool'}]")
    assert any("no builtin tool 'no_such_tool'" in p and "builtin:python" in p for p in found), found
    env = tmp_path / "game.py"
    env.write_text("class Game:\n    def reset(self, problem):\n        return []\n")
    found = problems("tiny_arith", "rollout.mode=env", f"rollout.env={env}:Game")
    assert any("rollout.env" in p and "async reset(problem) and async step" in p for p in found), found
    # without the machine's paths nothing is imported
    assert problems("tiny_tool", "rollout.tools=[{target: 'builtin:no_such_tool'}]", check_paths=False) == []


def test_the_tool_error_fraction_is_a_fraction() -> None:
    for value in ("-0.1", "1.5"):
        found = problems("tiny_tool", f"rollout.max_tool_error_fraction={value}", check_paths=False)
        assert any(
            f"rollout.max_tool_error_fraction must be in [0, 1] (got {float(value)})" in p
            and "0 stops at" in p
            for p in found
        ), found
    assert problems("tiny_tool", "rollout.max_tool_error_fraction=0", check_paths=False) == []


def test_the_rollouts_timeout_leaves_the_python_sandbox_its_own() -> None:
    python = "{target: 'builtin:python', timeout_s: %s, kwargs: {timeout_s: %s}}"
    found = problems("tiny_tool", f"rollout.tools=[{python % (10, 10)}]", check_paths=False)
    assert any(
        "rollout.tools[0]: builtin:python kills the model's code after kwargs.timeout_s=10" in p
        and "timeout_s=10: the model's slow code would count as the tool's failure" in p
        for p in found
    ), found
    found = problems(
        "tiny_tool", "rollout.tools=[{target: 'builtin:python', timeout_s: 5}]", check_paths=False
    )
    assert any("kwargs.timeout_s=10 but the rollout stops the call at timeout_s=5" in p for p in found), found
    assert problems("tiny_tool", f"rollout.tools=[{python % (15, 10)}]", check_paths=False) == []


def test_an_untrusted_python_tool_without_isolation_is_refused_at_validation() -> None:
    python = "{target: 'builtin:python', timeout_s: 15, kwargs: {timeout_s: 10, isolation: %s}}"
    found = problems("tiny_tool", f"rollout.tools=[{python % 'rlimits'}]")
    assert any("isolation=rlimits" in p and "trust_model_code: true" in p for p in found), found
    assert problems("tiny_tool", f"rollout.tools=[{python % 'auto'}]") == []  # this machine isolates
