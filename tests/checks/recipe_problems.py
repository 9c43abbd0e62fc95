"""What validation says of a recipe: the list of problems (empty when it validates), for the checks' tests."""

from __future__ import annotations

from dsv4rl.checks.validate import validate
from dsv4rl.config.compose import ConfigError, compose
from dsv4rl.config.schema import Config


def validation_problems(cfg: Config, check_paths: bool = False) -> list[str]:
    try:
        validate(cfg, check_paths=check_paths)
    except ConfigError as error:
        return error.problems
    return []


def recipe_problems(recipe: str, *overrides: str, check_paths: bool = False) -> list[str]:
    """`recipe` composed with `overrides`, validated (`check_paths`: also against this machine)."""
    return validation_problems(compose(recipe, list(overrides)), check_paths)
