"""The recipe's reward, checked before any process starts: every function of `reward.fns`, the remote
service and the judge.

`check_reward` reads only the recipe (names, weights, timeouts, the targets' form, the judge's template
and parse); `check_reward_targets` also reads this machine: each target's file exists, its module imports,
the function exists and its signature takes `(sample, **kwargs)` with the recipe's kwargs.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable
from typing import Any

from dsv4rl.checks.problems import Add
from dsv4rl.config.choices import GraderName
from dsv4rl.config.compose import reward_base_dirs
from dsv4rl.config.schema import Config, RewardFnConfig
from dsv4rl.reward.graders import GRADERS, grader_options
from dsv4rl.reward.group_filter import parse_filter
from dsv4rl.reward.judge import reply_parser, template_problem
from dsv4rl.reward.rewarder import effective_fns
from dsv4rl.targets import (
    BUILTIN,
    TargetError,
    form,
    is_async,
    keyword_problem,
    looks_like_target,
    parse,
    resolve,
)

_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_URL = re.compile(r"https?://\S+")
FORM = form("function", "grader")


def _where(index: int, fn: RewardFnConfig) -> str:
    return f"reward.fns[{index}]" + (f" ({fn.name})" if fn.name else "")


def _check_number(add: Add, key: str, value: float | None, low: float, fix: str, strict: bool = True) -> None:
    if value is None:
        return
    bad = not math.isfinite(value) or (value <= low if strict else value < low)
    if bad:
        add(f"{key}={value} must be {'>' if strict else '>='} {low:g}; {fix}")


def check_reward(cfg: Config, add: Add) -> None:
    """What can be checked from the recipe alone."""
    spec = cfg.algo.oversample.filter
    if spec and (spec.startswith(BUILTIN) or not looks_like_target(spec)):
        try:
            parse_filter(spec, ())
        except TargetError as error:
            add(str(error))
    r = cfg.reward
    names: list[str] = []
    weights: list[float] = []
    for index, fn in enumerate(r.fns):
        where = _where(index, fn)
        if not fn.name:
            add(f"{where}: name is empty; give each reward function a name (metrics: reward/<name>/score)")
        elif not _NAME.fullmatch(fn.name):
            add(
                f"{where}: name {fn.name!r} may use letters, digits, '_', '.', '-' only "
                "(it names metrics keys)"
            )
        names.append(fn.name)
        weights.append(fn.weight)
        if not fn.target:
            add(f"{where}: target is empty; set it to {FORM}")
        elif not looks_like_target(fn.target):
            add(f"{where}: target {fn.target!r} is not of the form {FORM}")
        elif fn.target.startswith(BUILTIN):
            _check_builtin(where, fn, add)
        if not math.isfinite(fn.weight):
            add(f"{where}: weight={fn.weight} must be a finite number (0: logged only)")
        _check_number(add, f"{where}.timeout_s", fn.timeout_s, 0, "the seconds one call may take")
    if r.remote.url:
        names.append(r.remote.name)
        weights.append(r.remote.weight)
        _check_remote(cfg, add)
    if r.judge.base_url:
        names.append(r.judge.name)
        weights.append(r.judge.weight)
        _check_judge(cfg, add)
    duplicates = sorted({n for n in names if n and names.count(n) > 1})
    if duplicates:
        add(f"reward function names repeat: {duplicates}; each needs its own (reward.remote.name, "
            "reward.judge.name too)")  # fmt: skip
    if (r.fns or r.remote.url or r.judge.base_url) and not any(w != 0 for w in weights):
        add("every reward function has weight 0 (logged only): give at least one a weight, or nothing trains")
    _check_number(
        add, "reward.async_concurrency", r.async_concurrency, 1, "async calls in flight", strict=False
    )
    if cfg.run.save_rollouts < 0:
        add(f"run.save_rollouts={cfg.run.save_rollouts} must be >= 0 (0: off; N: every N-th step's samples)")


def _check_builtin(where: str, fn: RewardFnConfig, add: Add) -> None:
    name = fn.target.removeprefix(BUILTIN)
    try:
        options = grader_options(name)
    except ValueError:
        graders = ", ".join(f"{BUILTIN}{g}" for g in GraderName)
        add(f"{where}: target {fn.target!r} names no grader; choose one of {graders}")
        return
    unknown = sorted(set(fn.kwargs) - set(options))
    if unknown:
        add(f"{where}: grader {name} does not take kwargs {unknown}; it takes {list(options)}")
    if fn.group:
        add(f"{where}: a builtin grader scores one sample at a time; set group: false")


def _check_remote(cfg: Config, add: Add) -> None:
    remote = cfg.reward.remote
    if not _URL.fullmatch(remote.url):
        add(f"reward.remote.url={remote.url!r} must be an http:// or https:// URL (empty: no remote reward)")
    _check_number(add, "reward.remote.batch_size", remote.batch_size, 1, "samples per POST", strict=False)
    _check_number(add, "reward.remote.timeout_s", remote.timeout_s, 0, "seconds per POST")
    _check_number(
        add, "reward.remote.retries", remote.retries, 0, "retries after the first try", strict=False
    )
    _check_number(add, "reward.remote.max_concurrency", remote.max_concurrency, 1, "POSTs in flight",
                  strict=False)  # fmt: skip
    if not _NAME.fullmatch(remote.name):
        add(f"reward.remote.name={remote.name!r} may use letters, digits, '_', '.', '-' only")
    if not math.isfinite(remote.weight):
        add(f"reward.remote.weight={remote.weight} must be a finite number")


def _check_judge(cfg: Config, add: Add) -> None:
    judge = cfg.reward.judge
    if not _URL.fullmatch(judge.base_url):
        add(f"reward.judge.base_url={judge.base_url!r} must be an http:// or https:// URL (empty: no judge)")
    problem = template_problem(judge.prompt_template)
    if problem:
        add(f"reward.judge.prompt_template {problem}")
    if judge.parse != "number" and not looks_like_target(judge.parse):
        try:
            re.compile(judge.parse)
        except re.error as error:
            add(
                f"reward.judge.parse={judge.parse!r} is neither 'number', pkg.module:function nor a "
                f"regex ({error})"
            )
    for key in ("rpm", "tpm", "retries"):
        _check_number(
            add, f"reward.judge.{key}", getattr(judge, key), 0, "0: no limit / no retry", strict=False
        )
    _check_number(
        add, "reward.judge.max_concurrency", judge.max_concurrency, 1, "requests in flight", strict=False
    )
    _check_number(add, "reward.judge.timeout_s", judge.timeout_s, 0, "seconds per request")
    _check_number(add, "reward.judge.max_tokens", judge.max_tokens, 1, "the reply's token cap", strict=False)
    if not _NAME.fullmatch(judge.name):
        add(f"reward.judge.name={judge.name!r} may use letters, digits, '_', '.', '-' only")
    if not math.isfinite(judge.weight) or not math.isfinite(judge.scale):
        add("reward.judge.weight and reward.judge.scale must be finite numbers")


def signature_problem(function: Callable[..., Any], kwargs: dict[str, Any], group: bool) -> str | None:
    """Why `function(sample, **kwargs)` (a group function: `function(samples, **kwargs)`) cannot be called
    as documented, or None."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return None  # a builtin or C function: nothing to check
    first = "samples: list[RewardInput]" if group else "sample: RewardInput"
    name = getattr(function, "__name__", "f")
    misspelled = keyword_problem(function, kwargs, skip=1)
    if misspelled:
        return f"{name}{signature}: {misspelled}"
    named = "".join(f", {key}=..." for key in kwargs)
    try:
        signature.bind(object(), **kwargs)
    except TypeError as error:
        return (
            f"{name}{signature} cannot be called as {name}({first.split(':')[0]}{named}) ({error}); define "
            f"it as `def {name}({first}, **kwargs)`" + (" (group: true)" if group else "")
        )
    return None


def filter_signature_problem(function: Callable[..., Any]) -> str | None:
    """Why `function(group, rewards=...)` cannot be called as a group filter, or None."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return None
    name = getattr(function, "__name__", "f")
    if is_async(function):
        return f"{name} is async; a filter runs in a worker process: define it with a plain `def`"
    try:
        signature.bind(object(), rewards=[])
    except TypeError as error:
        return (
            f"{name}{signature} cannot be called as {name}(group, rewards=...) ({error}); define it as "
            f"`def {name}(group: list[RewardInput], rewards: list[float]) -> bool`"
        )
    return None


def check_reward_targets(cfg: Config, add: Add) -> None:
    """Each function's target on this machine: found, imported, named, callable as documented."""
    dirs = reward_base_dirs(cfg)
    for index, fn in enumerate(effective_fns(cfg.reward)):
        if not fn.target or not looks_like_target(fn.target) or fn.target.startswith(BUILTIN):
            continue  # refused by check_reward already, or a builtin (checked there)
        where = _where(index, fn)
        try:
            function = resolve(parse(fn.target, dirs, GRADERS, builtin_noun="grader"))
        except TargetError as error:
            add(f"{where}: {error}")
            continue
        problem = signature_problem(function, fn.kwargs, fn.group)
        if problem:
            add(f"{where}: target {fn.target!r}: {problem}")
    spec = cfg.algo.oversample.filter
    if spec and not spec.startswith(BUILTIN) and looks_like_target(spec):
        try:
            function = resolve(parse_filter(spec, dirs))
        except TargetError as error:
            add(str(error))
        else:
            problem = filter_signature_problem(function)
            if problem:
                add(f"algo.oversample.filter {spec!r}: {problem}")
    judge = cfg.reward.judge
    if judge.base_url and judge.parse != "number" and looks_like_target(judge.parse):
        try:
            reply_parser(judge.parse, dirs)
        except (TargetError, ValueError) as error:
            add(f"reward.judge.parse: {error}")
