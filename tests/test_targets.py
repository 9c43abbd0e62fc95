"""The one target loader (dsv4rl.targets): its three forms, and the same errors for every kind of target
(reward functions, tools, environments), each naming the fix."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4rl.config.schema import RewardConfig, RewardFnConfig, ToolConfig
from dsv4rl.reward.graders import GRADERS, ArithGrader
from dsv4rl.reward.rewarder import RewardSet
from dsv4rl.rollout.multi_turn import load_env
from dsv4rl.targets import TargetError, form, load, looks_like_target, parse, resolve
from dsv4rl.tools.loading import BUILTINS as TOOL_BUILTINS
from dsv4rl.tools.loading import build_tool
from dsv4rl.tools.lookup import LookupTool

USER_CODE = """
import json
from dataclasses import dataclass

def score(sample, **kwargs):
    return 1.0

def _private():
    pass

@dataclass
class Game:
    size: int = 3

LIMIT = 3
"""


@pytest.fixture
def recipe_dir(tmp_path: Path) -> Path:
    (tmp_path / "rewards.py").write_text(USER_CODE)
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "games.py").write_text(USER_CODE)
    return tmp_path


# ------------------------------------------------------------------------------------------- the forms
def test_the_three_forms(recipe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    elsewhere = tmp_path_factory.mktemp("cwd")
    builtin = parse("builtin:lookup", [], TOOL_BUILTINS)
    assert (builtin.kind, builtin.builtin, builtin.ref, builtin.attr) == (
        "builtin", "lookup", "dsv4rl.tools.lookup", "LookupTool",
    )  # fmt: skip
    assert resolve(builtin, what="class") is LookupTool
    assert load("os.path:join") is os.path.join
    relative = parse("lib/games.py:Game", [elsewhere, recipe_dir])  # found in the second base directory
    assert relative.kind == "file" and relative.ref == str(recipe_dir / "lib" / "games.py")
    absolute = parse(f"{recipe_dir / 'rewards.py'}:score", [elsewhere])
    assert resolve(absolute)(None) == 1.0
    assert str(absolute) == f"{recipe_dir / 'rewards.py'}:score"  # messages show it as written


def test_a_file_is_one_module_however_often_it_is_loaded(recipe_dir: Path) -> None:
    first = load("lib/games.py:Game", [recipe_dir], what="class")
    again = load(f"{recipe_dir / 'lib' / 'games.py'}:Game", [], what="class")
    assert first is again and first.__module__ in sys.modules  # pickling finds it by name


def test_looks_like_target() -> None:
    for text in ("builtin:arith", "pkg.mod:fn", "dir/file.py:fn"):
        assert looks_like_target(text)
    for text in ("score: (\\d+)", "number", "pkg.mod"):
        assert not looks_like_target(text)


# ------------------------------------------------------------------------------------------- the errors
def test_a_missing_file_names_the_nearest_files(recipe_dir: Path) -> None:
    with pytest.raises(TargetError) as caught:
        parse("reward.py:score", [recipe_dir])
    message = str(caught.value)
    assert f"file 'reward.py' not found (looked for {recipe_dir / 'reward.py'})" in message
    assert "(did you mean 'rewards.py'?)" in message and "relative to the recipe's directory" in message
    with pytest.raises(TargetError, match=r"did you mean 'lib/games\.py'\?"):
        parse("lib/game.py:Game", [recipe_dir])
    with pytest.raises(TargetError, match=r"did you mean 'lib/games\.py'\?"):  # a folder misspelled too
        parse("libs/games.py:Game", [recipe_dir])


def test_an_unknown_name_lists_what_the_module_defines(recipe_dir: Path) -> None:
    with pytest.raises(TargetError) as caught:
        load("rewards.py:scor", [recipe_dir])
    message = str(caught.value)
    # its own public functions only: not `_private`, not `dataclass` that it imports
    assert "has no function 'scor' (its functions: score; did you mean 'score'?)" in message
    assert "fix the name after the colon" in message
    with pytest.raises(
        TargetError, match=r"has no class 'Gmae' \(its classes: Game; did you mean 'Game'\?\)"
    ):
        load("rewards.py:Gmae", [recipe_dir], what="class")
    with pytest.raises(
        TargetError, match=r"has 'LIMIT', but it is int 3, not a function \(its functions: score\)"
    ):
        load("rewards.py:LIMIT", [recipe_dir])  # there, but not callable
    with pytest.raises(TargetError, match=r"its classes and functions: Game, score"):
        load("rewards.py:nothing", [recipe_dir], what="class or function")


def test_builtins_missing_misspelled_or_none() -> None:
    with pytest.raises(TargetError) as caught:
        parse("builtin:lookups", [], TOOL_BUILTINS, role="tool target", builtin_noun="tool")
    assert str(caught.value) == (
        "tool target 'builtin:lookups': no builtin tool 'lookups' (did you mean builtin:lookup?); choose one "
        "of builtin:python, builtin:lookup"
    )
    with pytest.raises(TargetError, match=r"there is no builtin environment; give pkg\.module:Class or "):
        parse("builtin:maze", [], None, role="rollout.env", what="class", builtin_noun="environment")


def test_a_module_that_is_missing_or_fails_to_import(recipe_dir: Path) -> None:
    with pytest.raises(TargetError, match="no module 'dsv4rl_no_such_pkg' on the Python path.*PYTHONPATH"):
        load("dsv4rl_no_such_pkg.rewards:score")
    (recipe_dir / "broken.py").write_text("raise RuntimeError('needs a GPU')\n")
    for _ in range(2):  # not cached half-imported: the second load says the same
        with pytest.raises(TargetError, match=r"running .*broken\.py raised RuntimeError\('needs a GPU'\)"):
            load("broken.py:score", [recipe_dir])


def test_not_a_target() -> None:
    with pytest.raises(TargetError, match="is not of the form builtin:<grader>, pkg.module:function or"):
        parse("score the answer", [], GRADERS, builtin_noun="grader")
    assert form("class", "environment") == "builtin:<environment>, pkg.module:Class or path/to/file.py:Class"


def test_every_kind_of_target_says_the_same(recipe_dir: Path) -> None:
    """Reward functions, tools and environments load through the one loader: one misspelling, one advice."""
    dirs = [recipe_dir]
    reward = RewardConfig(fns=[RewardFnConfig(name="r", target="reward.py:score")])
    failures = []
    for build in (
        lambda: RewardSet.from_config(reward, dirs),
        lambda: build_tool(ToolConfig(target="reward.py:score"), dirs),
        lambda: load_env("reward.py:Game", {}, dirs),
    ):
        with pytest.raises(TargetError) as caught:
            build()
        failures.append(str(caught.value))
    assert all("file 'reward.py' not found" in f and "did you mean 'rewards.py'?" in f for f in failures)
    assert [f.split(" 'reward.py:")[0] for f in failures] == ["target", "tool target", "rollout.env"]
    grader = RewardSet.from_config(RewardConfig(fns=[RewardFnConfig(name="a", target="builtin:arith")]), dirs)
    assert isinstance(grader.scorers[0].grader, ArithGrader)


def test_the_loader_imports_nothing_of_dsv4rl() -> None:
    """It sits on the bottom floor: every layer may use it."""
    code = "import sys, dsv4rl.targets; print(sorted(m for m in sys.modules if m.startswith('dsv4rl')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['dsv4rl', 'dsv4rl.targets']"
