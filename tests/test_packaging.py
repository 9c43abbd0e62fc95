"""The wheel carries the recipes, and an installed (non-editable) package finds them."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_ships_recipes_and_finds_them(tmp_path: Path) -> None:
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = tmp_path.glob("dsv4rl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "dsv4rl/recipes/tiny_arith.yaml" in names
    assert "dsv4rl/recipes/dapo_math.yaml" in names
    assert "dsv4rl/recipes/comm/rccl_mi355x.yaml" in names
    assert "dsv4rl/engine/sglang_contract.json" in names  # the tests and the planner read it
    assert "dsv4rl/engine/sglang_site/sitecustomize.py" in names  # SGLang engines' PYTHONPATH

    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = (
        "from dsv4rl.config.compose import compose, find_recipes_dir;"
        "print(find_recipes_dir()); print(compose('tiny_arith', []).algo.group_size)"
    )
    env = {key: value for key, value in os.environ.items() if key != "DSV4RL_RECIPES"}
    env["PYTHONPATH"] = str(site)
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    found, group_size = result.stdout.split()
    assert Path(found) == site / "dsv4rl" / "recipes"
    assert int(group_size) > 1
