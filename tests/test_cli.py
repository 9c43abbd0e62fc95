"""The `dsv4rl` CLI: argument handling, --cfg, error display and the hand-off to the supervisor."""

from __future__ import annotations

import sys
import types

import pytest
from typer.testing import CliRunner

from dsv4rl.cli import app
from dsv4rl.config.schema import Config

runner = CliRunner()


@pytest.fixture
def supervisor(monkeypatch: pytest.MonkeyPatch) -> list[Config]:
    """A fake `dsv4rl.launcher.supervisor` that records the configs it was asked to run."""
    calls: list[Config] = []
    module = types.ModuleType("dsv4rl.launcher.supervisor")

    def run_training(cfg: Config) -> int:
        calls.append(cfg)
        return 0 if cfg.train.steps != 7 else 3

    module.run_training = run_training  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "dsv4rl.launcher.supervisor", module)
    return calls


def test_train_composes_validates_and_runs(supervisor: list[Config]) -> None:
    result = runner.invoke(
        app, ["train", "recipe=tiny_arith", "run.dir=runs/demo", "algo.group_size=4", "resume=true"]
    )
    assert result.exit_code == 0, result.output
    (cfg,) = supervisor
    assert (cfg.recipe, cfg.run.dir, cfg.algo.group_size, cfg.resume) == ("tiny_arith", "runs/demo", 4, True)


def test_train_exits_with_the_supervisor_code(supervisor: list[Config]) -> None:
    result = runner.invoke(app, ["train", "recipe=tiny_arith", "train.steps=7"])
    assert result.exit_code == 3


@pytest.mark.parametrize("flag", ["--cfg", "--print-config"])
def test_cfg_prints_yaml_and_starts_nothing(supervisor: list[Config], flag: str) -> None:
    result = runner.invoke(app, ["train", "recipe=tiny_arith", flag, "algo.group_size=4"])
    assert result.exit_code == 0, result.output
    assert "recipe: tiny_arith" in result.output and "group_size: 4" in result.output
    assert supervisor == []


def test_cfg_skips_path_checks_for_cluster_recipe(supervisor: list[Config]) -> None:
    result = runner.invoke(app, ["train", "recipe=dapo_math", "--cfg"])
    assert result.exit_code == 0, result.output
    assert "path: /path/to/DeepSeek-V4-Flash" in result.output and "backend: megatron" in result.output
    assert supervisor == []


def test_train_runs_path_checks(supervisor: list[Config]) -> None:
    result = runner.invoke(app, ["train", "recipe=dapo_math"])
    assert result.exit_code == 2
    assert "model.path" in result.output and "Traceback" not in result.output
    assert supervisor == []


def test_missing_recipe_lists_recipes(supervisor: list[Config]) -> None:
    result = runner.invoke(app, ["train", "run.dir=x"])
    assert result.exit_code == 2
    assert "no recipe given" in result.output and "dapo_math, tiny_arith" in result.output


def test_config_errors_exit_2_without_traceback(supervisor: list[Config]) -> None:
    result = runner.invoke(app, ["train", "recipe=tiny_arith", "algo.grup_size=4"])
    assert result.exit_code == 2
    assert "error: unknown key 'algo.grup_size'" in result.output
    assert "valid keys under algo" in result.output and "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_validation_errors_exit_2(supervisor: list[Config]) -> None:
    result = runner.invoke(app, ["train", "recipe=tiny_arith", "algo.group_size=1"])
    assert result.exit_code == 2 and "algo.group_size=1" in result.output
    assert supervisor == []


def test_recipes_command_lists_recipes_and_groups() -> None:
    result = runner.invoke(app, ["recipes"])
    assert result.exit_code == 0, result.output
    for name in ("tiny_arith", "dapo_math", "parallel", "flash_4node_disagg", "rccl_mi355x", "aime24"):
        assert name in result.output
