"""Tools from the recipe (`rollout.tools`): each entry's target loaded, instantiated and checked once.

A target is `builtin:<name>` (`python`, `lookup`), `pkg.module:Name` or `path/to/file.py:Name` (relative to
the recipe's directory or the working directory). `Name` is a class implementing `dsv4rl.tools.base.Tool`
(built with the entry's `kwargs`) or a plain function (a stateless tool whose schema comes from its
signature and docstring).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dsv4rl.config.schema import ToolConfig
from dsv4rl.targets import TargetError, keyword_problem, load
from dsv4rl.tools.base import FunctionTool, Tool
from dsv4rl.tools.sandbox.isolation import GUARANTEES

BUILTINS = {"python": "dsv4rl.tools.python_tool:PythonTool", "lookup": "dsv4rl.tools.lookup:LookupTool"}
METHODS = ("open", "call", "close")


def build_tool(entry: ToolConfig, base_dirs: Sequence[Path]) -> Tool:
    """One entry of `rollout.tools` as a ready tool; TargetError (naming the fix) when it cannot be."""
    found = load(
        entry.target, base_dirs, BUILTINS, role="tool target", what="class or function", builtin_noun="tool"
    )
    kwargs = dict(entry.kwargs)
    if inspect.isclass(found):
        misspelled = keyword_problem(found, kwargs)
        if misspelled:
            raise TargetError(f"tool {entry.target!r}: {found.__name__}: {misspelled}")
        try:
            tool = found(**kwargs)
        except TypeError as error:
            raise TargetError(
                f"tool {entry.target!r}: {found.__name__}(**{kwargs}) failed: {error}; fix the entry's kwargs"
            ) from None
        except Exception as error:  # a constructor's own failure: named, so validation reports it
            raise TargetError(
                f"tool {entry.target!r}: {found.__name__}(**{kwargs}) raised {error!r}; fix the entry's "
                "kwargs or what the tool needs"
            ) from error
        missing = [m for m in METHODS if not inspect.iscoroutinefunction(getattr(tool, m, None))]
        if not isinstance(getattr(tool, "schema", None), dict):
            missing.append("schema")
        if not entry.name and not (isinstance(getattr(tool, "name", None), str) and tool.name):
            missing.append("name")
        if missing:
            raise TargetError(
                f"tool {entry.target!r}: {found.__name__} is not a dsv4rl tool (needs `name`, a `schema` "
                f"dict and async {', '.join(METHODS)}; missing or not async: {missing}); see "
                "dsv4rl.tools.base.Tool, or give a plain function"
            )
        if entry.name:
            tool.name = entry.name
            tool.schema = {**tool.schema, "name": entry.name}
        # The prompt's tool block (and DSML's parser) name a tool by its schema; the rollout runs it by name.
        if "name" not in tool.schema:
            tool.schema = {**tool.schema, "name": tool.name}
        schema_name = tool.schema["name"]
        if schema_name != tool.name:
            raise TargetError(
                f"tool {entry.target!r}: {found.__name__}.name is {tool.name!r} but its schema's name is "
                f"{schema_name!r} (the model calls the schema's name): make them equal, or give the entry a "
                "`name`"
            )
        return tool
    if callable(found):
        if kwargs:
            raise TargetError(
                f"tool {entry.target!r}: a function tool takes no kwargs (got {sorted(kwargs)}); "
                "give it a class, or drop kwargs"
            )
        return FunctionTool(found, name=entry.name)
    raise TargetError(f"tool {entry.target!r} is neither a class nor a function")


def build_tools(entries: Sequence[ToolConfig], base_dirs: Sequence[Path]) -> list[Tool]:
    """Every tool of the recipe; names must be unique (the model calls them by name)."""
    tools = [build_tool(entry, base_dirs) for entry in entries]
    names = [tool.name for tool in tools]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise TargetError(f"rollout.tools has two tools named {repeated}: give one a `name`")
    return tools


def tool_problems(entries: Sequence[ToolConfig], base_dirs: Sequence[Path]) -> list[str]:
    """What is wrong with `rollout.tools`, for validation before anything starts (each with its fix)."""
    problems = []
    for index, entry in enumerate(entries):
        if not entry.target:
            problems.append(f"rollout.tools[{index}].target is empty; e.g. builtin:python")
            continue
        if entry.timeout_s <= 0:
            problems.append(f"rollout.tools[{index}].timeout_s must be > 0 (got {entry.timeout_s})")
    if problems:
        return problems
    try:
        build_tools(entries, base_dirs)
    except (TargetError, ValueError, RuntimeError) as error:
        problems.append(str(error))
    return problems


def tool_isolation(tool: Tool) -> dict[str, Any]:
    """Where a built tool's calls run and what isolates them (for `dsv4rl plan` and `dsv4rl doctor`)."""
    plan = getattr(tool, "plan", None)
    if plan is None:  # a user's tool: plain code of the recipe's author, in the trainer's process
        return {"isolation": "none (your tool's code runs in the trainer's process)"}
    return {
        "isolation": str(plan.mode),
        "layers": {g: plan.layers[g] for g in GUARANTEES if g in plan.layers},
        "memory_mb": getattr(tool, "memory_mb", None),  # per call, over all of its processes
        "max_processes": plan.max_processes,
        "notes": list(plan.notes),
    }
