"""`dsv4rl eval` of the recipe's own task (no eval set named): the recipe's reward functions grade, with its
sampling caps; a named eval set keeps its own grader and sampling. The report says which scored it."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from dsv4rl.cli import app
from dsv4rl.config.choices import EvalScoredBy
from dsv4rl.config.compose import ConfigError, compose
from dsv4rl.eval.recipe_reward import describe_reward, full_weight, pass_threshold
from dsv4rl.eval.view import render_eval
from dsv4rl.launcher.eval_run import eval_config

FUNCTIONS = Path(__file__).resolve().parent / "functions" / "eval_rewards.py"


def fns(*entries: tuple[str, float]) -> str:
    """A `reward.fns=[...]` override of eval_rewards.py's functions, (name, weight) each."""
    listed = ", ".join(f"{{name: {n}, target: '{FUNCTIONS}:{n}', weight: {w}}}" for n, w in entries)
    return f"reward.fns=[{listed}]"


def quiet() -> Console:
    return Console(file=io.StringIO())


def test_no_eval_set_takes_the_recipes_reward_and_caps_a_named_set_keeps_its_own(tmp_path: Path) -> None:
    args = [f"run.dir={tmp_path}", fns(("always_one", 1.0)), "algo.sampling.max_new_tokens=3"]
    mine = eval_config(None, "tiny_arith", args, None, None, None, quiet())
    assert mine.eval.scored_by == EvalScoredBy.recipe
    assert mine.eval.sampling == mine.algo.sampling and mine.eval.sampling.max_new_tokens == 3
    assert mine.eval.name == "tiny_arith"  # the recipe's eval group gives the problems
    assert Path(mine.run.dir) == tmp_path / "eval" / "tiny_arith-recipe"

    named = eval_config("tiny_arith", "tiny_arith", args, None, None, None, quiet())
    assert named.eval.scored_by == EvalScoredBy.eval_set and named.eval.grader == "arith"
    assert named.eval.sampling.max_new_tokens == 1  # the set's one-token cap, as before
    assert Path(named.run.dir) == tmp_path / "eval" / "tiny_arith"


def test_a_recipe_without_an_eval_set_is_told_how_to_name_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"has no eval set \(eval: none\).*add eval=<set>"):
        eval_config(None, "tiny_tool", [f"run.dir={tmp_path}"], None, None, None, quiet())
    cfg = eval_config(
        None, "tiny_tool", [f"run.dir={tmp_path}", "eval=tiny_arith"], None, None, None, quiet()
    )
    assert cfg.eval.scored_by == EvalScoredBy.recipe


def test_the_pass_threshold_is_the_positive_weight_sum_unless_set() -> None:
    cfg = compose("tiny_arith", [fns(("always_one", 1.0), ("half", 0.5), ("exact_digit", 0.0))])
    assert full_weight(cfg.reward) == 1.5 and pass_threshold(cfg) == 1.5
    assert describe_reward(cfg.reward) == "reward.fns: always_one (weight 1), half (0.5), exact_digit (0)"
    cfg = compose("tiny_arith", [fns(("always_one", 1.0), ("half", -0.5)), "eval.pass_reward=0.25"])
    assert full_weight(cfg.reward) == 1.0 and pass_threshold(cfg) == 0.25
    short = compose("tiny_arith")  # the reward.grader short form: one builtin of weight 1
    assert pass_threshold(short) == 1.0 and describe_reward(short.reward) == "reward.fns: arith (weight 1)"


def test_a_pass_threshold_without_the_recipes_reward_is_refused() -> None:
    from dsv4rl.checks.validate import validate

    with pytest.raises(ConfigError, match=r"eval.pass_reward=0.5 .* set eval.scored_by=recipe"):
        validate(compose("tiny_arith", ["eval.pass_reward=0.5"]))
    validate(compose("tiny_arith", ["eval.pass_reward=0.5", "eval.scored_by=recipe"]))  # periodic evals too


def saved(tmp_path: Path, answers: list[str]) -> Path:
    """Saved responses for the first tiny_arith problems (0+0, 0+1, ...), each answer once."""
    path = tmp_path / "responses.jsonl"
    ids = ["0+0", "0+1", "0+2", "0+3"][: len(answers)]
    path.write_text(
        "".join(
            json.dumps({"id": i, "responses": [a, "9"]}) + "\n" for i, a in zip(ids, answers, strict=True)
        )
    )
    return path


def invoke(*argv: str) -> dict:
    result = CliRunner().invoke(app, ["eval", *argv, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_the_recipes_functions_grade_and_the_report_names_them(tmp_path: Path) -> None:
    """The first word is an override, so no eval set is named: the recipe's functions grade (through the
    reward worker pool, as in training); `avg@n` is the mean reward total."""
    responses = saved(tmp_path, ["0", "1", "5", "3"])  # three right, plus a wrong "9" each
    run = f"run.dir={tmp_path / 'run'}"
    mine = invoke(fns(("always_one", 1.0)), run, "--responses", str(responses))
    assert mine["pass@1"] == 1.0 and mine["avg@2"] == 1.0
    assert (mine["scored_by"], mine["grader"], mine["pass_reward"]) == (
        "recipe", "reward.fns: always_one (weight 1)", 1.0,
    )  # fmt: skip
    assert mine["reward_functions"]["reward/always_one/score"] == 1.0
    assert (tmp_path / "run" / "eval" / "tiny_arith-recipe" / "eval.json").is_file()

    both = invoke(
        "recipe=tiny_arith",
        fns(("exact_digit", 1.0), ("always_one", 0.5)),
        run,
        "--responses",
        str(responses),
    )
    assert both["pass@1"] == 3 / 8  # passes need the full 1.5: the right answers only
    assert both["avg@2"] == pytest.approx((3 * 1.5 + 5 * 0.5) / 8)
    assert [row["correct"] for row in both["per_problem"]] == [1, 1, 0, 1]
    lenient = invoke(
        fns(("exact_digit", 1.0), ("always_one", 0.5)),
        run,
        "eval.pass_reward=0.5",
        "--responses",
        str(responses),
    )
    assert lenient["pass@1"] == 1.0 and lenient["pass_reward"] == 0.5

    named = invoke("tiny_arith", fns(("always_one", 1.0)), run, "--responses", str(responses))
    assert (named["scored_by"], named["grader"]) == ("eval_set", "arith")  # the set's grader, as before
    assert named["pass@1"] == 3 / 8 and named["avg@2"] == named["pass@1"]

    console = Console(file=io.StringIO(), width=200)
    render_eval(mine, console)
    assert (
        "scored by the recipe's reward.fns: always_one (weight 1); pass at reward >= 1"
        in console.file.getvalue()
    )
    render_eval({**mine, "pass@1": 0.0, "avg@2": 0.5}, console)
    assert "no response reached reward 1 (mean reward 0.5)" in console.file.getvalue()
    render_eval(named, console)
    assert "scored by the eval set's grader arith" in console.file.getvalue()


def test_a_failing_reward_function_stops_the_eval_loudly(tmp_path: Path) -> None:
    """A function that raises on every response is a broken reward, never a score of zero."""
    broken = tmp_path / "broken.py"
    broken.write_text("def f(sample, **kwargs):\n    raise KeyError('no such column')\n")
    override = f"reward.fns=[{{name: f, target: '{broken}:f'}}]"
    result = CliRunner().invoke(
        app, ["eval", override, f"run.dir={tmp_path / 'run'}", "--responses", str(saved(tmp_path, ["0"] * 4))]
    )
    assert result.exit_code == 1
    assert "reward function 'f'" in result.output and "KeyError: 'no such column'" in result.output
