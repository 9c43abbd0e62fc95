"""The recipe's reward checked before anything starts: every problem named with its fix, all together with
the recipe's other problems (`dsv4rl.checks.reward`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from recipe_problems import recipe_problems
from typer.testing import CliRunner

import dsv4rl.launcher.run
from dsv4rl.cli import app

FNS = Path(__file__).resolve().parents[1] / "reward" / "user_fns.py"


def problems(*overrides: str, check_paths: bool = True) -> list[str]:
    return recipe_problems("tiny_arith", *overrides, check_paths=check_paths)


def fns(*entries: str) -> str:
    return "reward.fns=[" + ", ".join(entries) + "]"


def test_a_misspelled_target_a_missing_file_and_a_wrong_signature_together() -> None:
    found = problems(
        fns(
            "{name: a, target: dsv4rl_no_such_module:score}",
            "{name: b, target: no/such/file.py:score}",
            f"{{name: c, target: {FNS}:no_sample}}",
            f"{{name: d, target: {FNS}:ok, kwargs: {{level: 2}}}}",
            f"{{name: e, target: {FNS}:okk}}",
        ),
        "algo.group_size=1",
    )
    assert len(found) == 6, found
    assert any("algo.group_size=1" in p for p in found)
    text = "\n".join(found)
    assert (
        "reward.fns[0] (a): target 'dsv4rl_no_such_module:score': no module 'dsv4rl_no_such_module'" in text
    )
    assert "add it to PYTHONPATH, or give the file: path/to/file.py:score" in text
    assert "reward.fns[1] (b): target 'no/such/file.py:score': file 'no/such/file.py' not found" in text
    assert "relative to the recipe's directory or the working directory" in text
    assert (
        "reward.fns[2] (c): " in text
        and "define it as `def no_sample(sample: RewardInput, **kwargs)`" in text
    )
    assert "unknown keyword argument 'level' (it takes no keyword arguments)" in text
    assert "has no function 'okk'" in text and "fix the name after the colon" in text


def test_the_recipe_rules_of_functions_remote_and_judge() -> None:
    found = problems(
        fns("{name: '', target: 'builtin:arith'}", "{name: x, target: 'builtin:arith', kwargs: {tail: 3}}",
            "{name: x, target: 'builtin:arithm', weight: 0}", "{name: y, target: 'nope', timeout_s: 0}",
            "{name: g, target: 'builtin:dapo', group: true}"),
        "reward.remote.url=ftp://x", "reward.judge.base_url=http://j",
        "reward.judge.prompt_template='{answr}'",
        "reward.judge.parse='(['", "run.save_rollouts=-1",
        check_paths=False,
    )  # fmt: skip
    text = "\n".join(found)
    for words in (
        "reward.fns[0]: name is empty", "grader arith does not take kwargs ['tail']",
        "names no grader; choose one of builtin:arith", "target 'nope' is not of the form",
        "reward.fns[3] (y).timeout_s=0.0 must be > 0", "a builtin grader scores one sample at a time",
        "reward function names repeat: ['x']", "reward.remote.url='ftp://x' must be an http",
        "reward.judge.prompt_template names ['answr']", "reward.judge.parse='([' is neither",
        "run.save_rollouts=-1 must be >= 0",
    ):  # fmt: skip
        assert words in text, (words, found)


def test_only_logged_functions_is_refused() -> None:
    (found,) = problems(fns("{name: a, target: 'builtin:arith', weight: 0}"), check_paths=False)
    assert "every reward function has weight 0" in found


def test_valid_reward_functions_pass() -> None:
    assert (
        problems(fns(f"{{name: ok, target: {FNS}:ok}}", "{name: arith, target: 'builtin:arith', weight: 0}"))
        == []
    )


def test_train_refuses_before_any_process_starts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    started: list = []
    monkeypatch.setattr(dsv4rl.launcher.run, "run_training", lambda cfg: started.append(cfg) or 0)
    run_dir = tmp_path / "run"
    result = CliRunner().invoke(
        app, ["train", "recipe=tiny_arith", f"run.dir={run_dir}", fns("{name: ok, target: no/such.py:score}")]
    )
    assert result.exit_code == 2 and "file 'no/such.py' not found" in result.output, result.output
    assert started == [] and not run_dir.exists()
