"""Compose a recipe: Hydra config groups + command-line overrides -> a typed, schema-checked `Config`.

Recipes are YAML files in a `recipes/` directory: top-level files are recipes (`tiny_arith.yaml`),
sub-directories are config groups (`model/`, `parallel/`, ...). Every recipe lists `dsv4rl_schema`
first in its defaults, so Hydra merges the YAML into the structured schema: a key the schema lacks or a
wrongly typed value fails here, with a message that names the key and the valid choices, before any
process starts. Cross-field rules live in `dsv4rl.checks.validate`.
"""

from __future__ import annotations

import difflib
import functools
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    MissingMandatoryValue,
    OmegaConfBaseException,
    ValidationError,
)

from dsv4rl.config.schema import Config

RECIPES_ENV = "DSV4RL_RECIPES"
_PACKAGE_DIR = Path(__file__).resolve().parent.parent  # dsv4rl/ (config/ is one level down)
SCHEMA_NAME = "dsv4rl_schema"  # the ConfigStore entry every recipe lists first in its defaults


class ConfigError(ValueError):
    """A recipe, override or setting that cannot work. The message names the key and the fix."""

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = problems or [message]


# --------------------------------------------------------------------------------------------------
# Where the recipes are


def find_recipes_dir(package_dir: Path | None = None, environ: Mapping[str, str] | None = None) -> Path:
    """The recipes directory: $DSV4RL_RECIPES, else `<checkout>/recipes`, else `<package>/recipes`.

    A source checkout has `src/dsv4rl/../../recipes` next to `pyproject.toml`; an installed wheel
    carries the same tree at `dsv4rl/recipes` (force-included by pyproject.toml).
    """
    environ = os.environ if environ is None else environ
    override = environ.get(RECIPES_ENV)
    if override:
        path = Path(override).expanduser()
        if not path.is_dir():
            raise ConfigError(
                f"{RECIPES_ENV}={override!r} is not a directory; point it at a recipes directory"
            )
        return path.resolve()
    package_dir = _PACKAGE_DIR if package_dir is None else Path(package_dir)
    checkout_root = package_dir.parent.parent
    if (checkout_root / "pyproject.toml").is_file() and (checkout_root / "recipes").is_dir():
        return (checkout_root / "recipes").resolve()
    packaged = package_dir / "recipes"
    if packaged.is_dir():
        return packaged.resolve()
    raise ConfigError(
        f"no recipes directory found (looked in {checkout_root / 'recipes'} and {packaged}); "
        f"set {RECIPES_ENV}=<dir with recipe .yaml files>"
    )


def list_recipes(recipes_dir: Path | None = None) -> list[str]:
    """Recipe names: the top-level `.yaml` files."""
    root = find_recipes_dir() if recipes_dir is None else Path(recipes_dir)
    return sorted(p.stem for p in root.glob("*.yaml"))


def list_groups(recipes_dir: Path | None = None) -> dict[str, list[str]]:
    """Config groups and their options: `{"parallel": ["cpu_fsdp2", "cpu_single", ...], ...}`."""
    root = find_recipes_dir() if recipes_dir is None else Path(recipes_dir)
    return {
        d.name: sorted(p.stem for p in d.glob("*.yaml"))
        for d in sorted(root.iterdir())
        if d.is_dir() and not d.name.startswith((".", "_"))
    }


def describe(path: Path) -> str:
    """The first comment line of a recipe file (its one-line description), or ''."""
    for line in Path(path).read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#") and not stripped.startswith("# @package"):
            return stripped.lstrip("#").strip()
        if stripped and not stripped.startswith("#"):
            break
    return ""


# --------------------------------------------------------------------------------------------------
# Composition


def compose(recipe: str, overrides: list[str] | None = None, recipes_dir: Path | None = None) -> Config:
    """Compose `recipes/<recipe>.yaml` with Hydra overrides into a typed `Config`.

    Overrides use Hydra's grammar: `key=value`, `+key=value` (add a key, e.g. `+comm.env.X=1`),
    `group=option` (`parallel=cpu_fsdp2`). Raises ConfigError naming the bad key and the choices.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.core.global_hydra import GlobalHydra

    overrides = list(overrides or [])
    root = find_recipes_dir() if recipes_dir is None else Path(recipes_dir).resolve()
    recipe_file = recipe_path(recipe)
    if recipe_file is None:
        recipes = list_recipes(root)
        if recipe not in recipes:
            raise ConfigError(
                f"unknown recipe {recipe!r}; available recipes: {', '.join(recipes) or '(none)'} "
                "(or a recipe file: recipe=path/to/recipe.yaml)"
            )
        recipe_file = root / f"{recipe}.yaml"
    else:
        recipe = str(recipe_file)
    _check_schema_listed(recipe_file)
    groups = list_groups(root)
    _check_overrides(overrides, groups)
    overrides = [_resume_as_choice(text) for text in overrides]
    if recipe_file.parent != root:  # a recipe of its own: the groups and base recipes come from `root`
        overrides = [f"hydra.searchpath=[file://{root}]", *overrides]

    store = ConfigStore.instance()
    if f"{SCHEMA_NAME}.yaml" not in store.repo:  # stored once a process: the store converts the schema
        store.store(name=SCHEMA_NAME, node=Config)
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    _RECIPE_DIR[0] = str(recipe_file.parent)
    try:
        with initialize_config_dir(config_dir=str(recipe_file.parent), version_base=None, job_name="dsv4rl"):
            composed = hydra_compose(config_name=recipe_file.stem, overrides=overrides)
    except Exception as exc:  # Hydra and OmegaConf errors -> one readable message
        if "Unexpected type for root: NoneType" in str(exc):
            raise ConfigError(_null_section_message(recipe, overrides, groups, root)) from None
        raise ConfigError(_explain(exc, recipe, groups)) from None

    try:
        # Re-merge a plain copy: Hydra opens the struct flag for `+key=value`, so keys it added are only
        # caught when merged into a fresh structured Config.
        plain = OmegaConf.create(OmegaConf.to_container(composed, resolve=False))
        merged = OmegaConf.merge(_schema_template(), plain)  # merge copies the template
        merged.recipe = recipe
        return OmegaConf.to_object(merged)  # type: ignore[return-value]  # resolves interpolations
    except OmegaConfBaseException as exc:
        raise ConfigError(_explain(exc, recipe, groups, from_hydra=False)) from None


@functools.cache
def _schema_template() -> DictConfig:
    """The structured schema, built once a process (its dataclass introspection costs a third of a
    composition); `OmegaConf.merge` copies it, so every composition starts from a clean one."""
    return OmegaConf.structured(Config)


# `${recipe_dir:}` in a recipe: the directory of the recipe file being composed (an example recipe names its
# data and reward files next to it). Set by `compose` before Hydra reads the file.
_RECIPE_DIR = [""]
OmegaConf.register_new_resolver("recipe_dir", lambda: _RECIPE_DIR[0], replace=True)


def recipe_path(recipe: str) -> Path | None:
    """The recipe file `recipe=` names when it is a path (`examples/judge.yaml`), absolute; None for a
    recipe name. A path that does not exist is refused here."""
    if not recipe.endswith((".yaml", ".yml")):
        return None
    path = Path(recipe).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"recipe file {recipe!r} does not exist (from {Path.cwd()}); pass recipe=NAME for a recipe of "
            "the recipes directory or the path of a .yaml recipe file"
        )
    return path.resolve()


def reward_base_dirs(cfg: Config) -> list[Path]:
    """Where a relative `path/to/file.py:function` target is looked for: the recipe's directory, then the
    working directory."""
    return [recipe_dir(cfg), Path.cwd()]


def recipe_dir(cfg: Config) -> Path:
    """The directory a recipe's relative reward targets are resolved from: the recipe file's own, or the
    recipes directory for a recipe given by name."""
    path = Path(cfg.recipe)
    if cfg.recipe.endswith((".yaml", ".yml")) and path.is_absolute():
        return path.parent
    try:
        return find_recipes_dir()
    except ConfigError:
        return Path.cwd()


def load_config_file(path: str | Path) -> Config:
    """Read a composed config back (the `config.yaml` a run writes for its workers), schema-checked."""
    path = Path(path)
    try:
        raw = OmegaConf.load(path)
        if isinstance(raw, DictConfig) and isinstance(raw.get("resume"), bool):  # written when it was a bool
            raw.resume = str(raw.resume).lower()
        merged = OmegaConf.merge(OmegaConf.structured(Config), raw)
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{_explain(exc, str(path), {}, from_hydra=False)} (in {path})") from None


def to_dictconfig(cfg: Config) -> DictConfig:
    """The typed Config as an OmegaConf DictConfig (structured: keeps the schema's checks)."""
    return OmegaConf.structured(cfg)


def to_yaml(cfg: Config) -> str:
    """The composed config as YAML: what `dsv4rl train --cfg` prints and runs save beside results."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def _check_schema_listed(recipe_file: Path) -> None:
    raw = OmegaConf.load(recipe_file)
    defaults = raw.get("defaults") if isinstance(raw, DictConfig) else None
    if not defaults or SCHEMA_NAME not in [d for d in defaults if isinstance(d, str)]:
        raise ConfigError(
            f"recipe {recipe_file} must list `- {SCHEMA_NAME}` first in its `defaults:` "
            "(it merges the YAML into dsv4rl's schema, which rejects unknown keys and wrong types)"
        )


def _check_overrides(overrides: list[str], groups: dict[str, list[str]]) -> None:
    """Reject malformed overrides, sweeps and unknown group options before Hydra sees them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    for text in overrides:
        try:
            (override,) = parser.parse_overrides([text])
        except OverrideParseException as exc:
            reason = str(exc).splitlines()[0]
            raise ConfigError(
                f"cannot parse override {text!r} ({reason}); use key=value, +key=value or group=option"
            ) from None
        key = override.key_or_group
        if key == "recipe":
            raise ConfigError(f"{text!r}: the recipe is chosen once, as the `recipe=NAME` argument")
        if override.is_sweep_override():
            raise ConfigError(
                f"{text!r} is a sweep; dsv4rl runs one configuration: quote the value (key='a,b') "
                "or pass a list (key=[a,b])"
            )
        if key in groups and not override.is_delete():
            value = override.value()
            if not isinstance(value, str) or value not in groups[key]:
                raise ConfigError(
                    f"unknown option {value!r} for config group {key!r}; "
                    f"options in {key}: {', '.join(groups[key])}"
                )


def _resume_as_choice(text: str) -> str:
    """`resume=true` / `resume=false` as the ResumeMode names: Hydra reads them as booleans, which the
    enum-typed key would refuse, and `resume` was a bool before it took `auto`."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    key, _, _ = text.partition("=")
    if key.lstrip("+~") != "resume":
        return text
    (override,) = OverridesParser.create().parse_overrides([text])
    value = override.value()
    return f"{key}={str(value).lower()!r}" if isinstance(value, bool) else text


# --------------------------------------------------------------------------------------------------
# Error messages


def _omegaconf_cause(exc: BaseException) -> OmegaConfBaseException | None:
    seen = exc
    while seen is not None:
        if isinstance(seen, OmegaConfBaseException) and getattr(seen, "full_key", None):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _null_section_message(recipe: str, overrides: list[str], groups: dict[str, list[str]], root: Path) -> str:
    """Hydra's message for an override into a section the recipe leaves null (`eval: none`), made one that
    names the override and the fix."""

    def nullable(section: str) -> bool:  # the group has an option that sets the whole section to null
        option = root / section / "none.yaml"
        return "none" in groups.get(section, []) and f"{section}: null" in option.read_text()

    keys = [text.split("=", 1)[0].lstrip("+~") for text in overrides if "=" in text]
    nulls = [key for key in keys if "." in key and nullable(key.split(".", 1)[0])]
    if not nulls:
        return f"recipe {recipe!r}: an override sets a key under a section this recipe leaves null"
    section = nulls[0].split(".", 1)[0]
    options = ", ".join(option for option in groups[section] if option != "none")
    return (
        f"recipe {recipe!r}: {nulls[0]} sets a key of `{section}`, which this recipe leaves null "
        f"({section}: none): pick one first ({section}=<option>; options: {options}) or drop the override"
    )


def _explain(exc: BaseException, recipe: str, groups: dict[str, list[str]], from_hydra: bool = True) -> str:
    """Turn a Hydra/OmegaConf exception into one sentence naming the key, value and choices."""
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    missing = re.search(r"Could not find '([^'/]+)/([^']+)'", str(exc))
    if missing and missing.group(1) in groups:
        group, option = missing.groups()
        return (
            f"recipe {recipe!r}: unknown option {option!r} for config group {group!r}; "
            f"options in {group}: {', '.join(groups[group])}"
        )
    cause = _omegaconf_cause(exc)
    if cause is None:
        return f"recipe {recipe!r}: {first_line}"
    full_key = str(cause.full_key)
    in_list = _list_entry_key(cause)
    if in_list is not None:  # OmegaConf names a list entry's keys without the list's path
        return _list_entry_message(in_list, cause, full_key)
    # Hydra names the file it was merging ("Error merging 'algo/grpo'"); overrides speak for themselves.
    where = ""
    if from_hydra and "override" not in first_line:
        source = re.match(r"In '([^']+)'", first_line)
        where = f" (in {source.group(1)}.yaml of recipe {recipe!r})" if source else f" (recipe {recipe!r})"
    if isinstance(cause, ConfigAttributeError | ConfigKeyError):
        return _unknown_key_message(full_key) + where
    if isinstance(cause, MissingMandatoryValue):
        return f"{full_key} has no value (???); set it with {full_key}=<value>{where}"
    if isinstance(cause, ValidationError):
        expected = describe_type(schema_type(full_key))
        msg = str(cause.msg) if hasattr(cause, "msg") else str(cause)
        if "is not Optional" in msg:
            return f"{full_key} cannot be null; expected {expected}{where}"
        value = re.search(r"[Vv]alue '(.*?)'", msg)
        got = f", got {value.group(1)!r}" if value else ""
        return f"{full_key}: expected {expected}{got}{where}"
    return f"{full_key}: {str(cause).splitlines()[0]}{where}"


def _list_entry_key(cause: OmegaConfBaseException) -> str | None:
    """The list key (`reward.fns`) whose entries have the dataclass `cause` names, when it is a list entry."""
    kind = getattr(cause, "object_type", None)
    if kind is None or not is_dataclass(kind) or "." in str(cause.full_key):
        return None
    found = _lists_of(Config, "", kind)
    return found[0] if found else None


def _lists_of(node: Any, prefix: str, kind: type) -> list[str]:
    out = []
    for name, hint in typing.get_type_hints(node).items():
        hint = _strip_optional(hint)
        if typing.get_origin(hint) is list and typing.get_args(hint)[0] is kind:
            out.append(prefix + name)
        elif is_dataclass(hint):
            out += _lists_of(hint, f"{prefix}{name}.", kind)
    return out


def _list_entry_message(list_key: str, cause: OmegaConfBaseException, leaf: str) -> str:
    kind = cause.object_type
    valid = [f.name for f in fields(kind)]
    where = f"{list_key}[].{leaf}"
    if isinstance(cause, ConfigAttributeError | ConfigKeyError):
        close = difflib.get_close_matches(leaf, valid, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ";"
        return f"unknown key {where!r}{hint} valid keys of a {list_key} entry: {', '.join(valid)}"
    expected = describe_type(typing.get_type_hints(kind).get(leaf))
    msg = str(getattr(cause, "msg", cause))
    value = re.search(r"[Vv]alue '(.*?)'", msg)
    got = f", got {value.group(1)!r}" if value else ""
    return f"{where}: expected {expected}{got}"


def _unknown_key_message(full_key: str) -> str:
    parent, _, leaf = full_key.rpartition(".")
    parent_type = _strip_optional(schema_type(parent)) if parent else Config
    if typing.get_origin(parent_type) is dict:
        return f"{full_key} is not set yet; add a new entry with +{full_key}=<value>"
    if parent_type is None or not is_dataclass(parent_type):
        return f"unknown key {full_key!r}"
    valid = [f.name for f in fields(parent_type)]
    where = f"under {parent}" if parent else "at the top level"
    close = difflib.get_close_matches(leaf, valid, n=1)
    hint = f"; did you mean {(parent + '.' if parent else '') + close[0]!r}?" if close else ";"
    return f"unknown key {full_key!r}{hint} valid keys {where}: {', '.join(valid)}"


def schema_type(full_key: str) -> Any:
    """The schema's type annotation for a dotted key (`algo.group_size` -> int); None if unknown."""
    node: Any = Config
    # `engine.numerics_features[0]`: a list's element is one more step into the list's type
    for part in [p for p in re.sub(r"\[\d+\]", ".[]", full_key).split(".") if p]:
        node = _strip_optional(node)
        origin = typing.get_origin(node)
        if origin is dict:
            node = typing.get_args(node)[1]
        elif origin is list:
            node = typing.get_args(node)[0]
        elif is_dataclass(node):
            hints = typing.get_type_hints(node)
            if part not in hints:
                return None
            node = hints[part]
        else:
            return None
    return node


def describe_type(tp: Any) -> str:
    """A type annotation in words: `int`, `int or null`, `one of fsdp, megatron`, `list of int`."""
    if tp is None:
        return "a value"
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        inner = " or ".join(describe_type(a) for a in args)
        return f"{inner} or null" if len(args) < len(typing.get_args(tp)) else inner
    if origin is list:
        return f"a list of {describe_type(typing.get_args(tp)[0])}"
    if origin is dict:
        key, value = typing.get_args(tp)
        return f"a mapping of {describe_type(key)} to {describe_type(value)}"
    if isinstance(tp, type) and issubclass(tp, Enum):
        return "one of " + ", ".join(m.name for m in tp)
    if is_dataclass(tp):
        return f"a section ({', '.join(f.name for f in fields(tp))})"
    return getattr(tp, "__name__", str(tp))


def _strip_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp
