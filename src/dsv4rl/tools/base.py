"""What a tool is: a name, a JSON schema, and async open / call / close around one state per trajectory.

A rollout in `rollout.mode=tools` opens every tool once per trajectory (`open(problem)`), calls it for each
of the model's calls (`call(state, args)`), and closes it on every path out of the trajectory (an answer,
a budget, an error, an abort, a shutdown). A plain function becomes a tool through `FunctionTool`, its
schema derived from its signature and docstring.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import types
import typing
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass
class ToolResult:
    """What a call gives back: `text` goes to the model as the call's result; `reward` (optional) reaches
    the reward functions as a per-turn reward (`RewardInput.tool_rewards`); `done` ends the trajectory
    after this turn's results; `metrics` (numbers) are averaged into `tool/<key>`. `error` marks a
    call the model got wrong (its code raised or ran too long, a bad argument): the model sees `text` and
    learns from it (`tool/errors`). A tool that cannot do its job (its service is down, its sandbox cannot
    start) raises instead: that is the tool's failure, bounded by rollout.max_tool_error_fraction
    (dsv4rl.rollout.tool_failures)."""

    text: str
    reward: float | None = None
    done: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    error: bool = False
    timed_out: bool = False


@runtime_checkable
class Tool(Protocol):
    """A tool the model can call. `schema` is the OpenAI-style function schema
    (`{"name", "description", "parameters": <JSON schema of the arguments>}`)."""

    name: str
    schema: dict[str, Any]

    async def open(self, problem: Any) -> Any:
        """The state of one trajectory (`problem`: the data row it answers, a `dsv4rl.data.Problem`)."""

    async def call(self, state: Any, args: dict[str, Any]) -> ToolResult:
        """Run one call. Raise when the tool itself fails (the model gets a short error result, the run
        counts and logs it); return `ToolResult(error=True)` for the model's own mistakes."""

    async def close(self, state: Any) -> None:
        """Release the trajectory's state; called exactly once per `open`."""


def warn_old_row_name(method: Callable[..., Any], what: str) -> None:
    """A DeprecationWarning when `method` (a tool's `open`, an environment's `reset`) still names the data
    row `sample`: it is `problem` now. The old name keeps working for one release (the rollout passes the
    row by position)."""
    try:
        parameters = inspect.signature(method).parameters
    except (TypeError, ValueError):  # a builtin or a callable without a readable signature
        return
    if "sample" in parameters and "problem" not in parameters:
        warnings.warn(
            f"{what}: the data row's parameter is named `sample`; rename it `problem` (the old name is "
            "deprecated and stops working in the next release)",
            DeprecationWarning,
            stacklevel=3,
        )


_JSON_TYPES: dict[Any, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    list: "array",
    dict: "object",
}


def _json_type(annotation: Any) -> dict[str, Any]:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _json_type(options[0]) if len(options) == 1 else {}
    if origin is not None:
        annotation = origin
    name = _JSON_TYPES.get(annotation)
    return {"type": name} if name else {}


def _param_docs(doc: str) -> dict[str, str]:
    """`name: text` lines of a docstring's Args section (Google style)."""
    out, inside = {}, False
    for line in doc.splitlines():
        stripped = line.strip()
        if stripped.lower() in ("args:", "arguments:", "parameters:"):
            inside = True
            continue
        if inside:
            if not stripped:
                break
            name, sep, text = stripped.partition(":")
            if sep and name.split(" ")[0].isidentifier():
                out[name.split(" ")[0]] = text.strip()
    return out


# A function tool's parameters that the rollout fills, never the model: the data row the trajectory answers
# and a dict that lives as long as the trajectory (what a class tool keeps in its `open` state).
CONTEXT_PARAMETERS = ("problem", "state")


def function_schema(
    function: Callable[..., Any], name: str | None = None, skip: tuple[str, ...] = ()
) -> dict[str, Any]:
    """A function's tool schema: its name, the docstring's first paragraph as the description, one
    property per parameter (typed from the annotation, described from the docstring's Args section),
    parameters without a default required. `skip`: parameters the model does not see (the context)."""
    signature = inspect.signature(function)
    hints = typing.get_type_hints(function) if not isinstance(function, functools.partial) else {}
    doc = inspect.getdoc(function) or ""
    described = _param_docs(doc)
    properties, required = {}, []
    for param in signature.parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD) or param.name in skip:
            continue
        prop = _json_type(hints.get(param.name, param.annotation))
        if param.name in described:
            prop["description"] = described[param.name]
        properties[param.name] = prop
        if param.default is param.empty:
            required.append(param.name)
    return {
        "name": name or function.__name__,
        "description": doc.split("\n\n")[0].replace("\n", " ").strip(),
        "parameters": {"type": "object", "properties": properties, "required": required},
    }


@dataclass
class FunctionToolState:
    """One trajectory's context for a function tool that declares it: the data row and a dict that lives
    from the trajectory's first call to its last."""

    problem: Any
    state: dict[str, Any] = field(default_factory=dict)


class FunctionTool:
    """A plain function (sync or async) as a tool. It returns a string, a number, a dict with `text` (and
    optionally `reward`, `done`, `metrics`) or a `ToolResult`; a sync function runs in a thread so it
    never blocks the rollout's event loop. A parameter named `problem` gets the trajectory's data row and
    one named `state` a dict kept across the trajectory's calls; the model sees neither (not in the
    schema, and never taken from its arguments)."""

    def __init__(self, function: Callable[..., Any], name: str | None = None, schema: dict | None = None):
        self.function = function
        try:
            declared = inspect.signature(function).parameters
        except (TypeError, ValueError):
            declared = {}
        self.context = tuple(p for p in CONTEXT_PARAMETERS if p in declared)
        self.schema = schema or function_schema(function, name, skip=self.context)
        self.name = name or self.schema["name"]

    async def open(self, problem: Any) -> FunctionToolState | None:
        return FunctionToolState(problem) if self.context else None

    async def call(self, state: Any, args: dict[str, Any]) -> ToolResult:
        if self.context:
            args = {**args, **{name: getattr(state, name) for name in self.context}}
        if inspect.iscoroutinefunction(self.function):
            value = await self.function(**args)
        else:
            value = await asyncio.to_thread(self.function, **args)
        return as_tool_result(value)

    async def close(self, state: Any) -> None:
        return None


def as_tool_result(value: Any) -> ToolResult:
    """A tool's return value as a `ToolResult`."""
    if isinstance(value, ToolResult):
        return value
    if isinstance(value, dict) and "text" in value:
        return ToolResult(
            text=str(value["text"]),
            reward=value.get("reward"),
            done=bool(value.get("done", False)),
            metrics={k: float(v) for k, v in value.get("metrics", {}).items()},
        )
    return ToolResult(text=value if isinstance(value, str) else str(value))


def schema_problems(schema: dict[str, Any], args: Any) -> list[str]:
    """Why `args` does not fit the schema's parameters (objects, required keys, unknown keys, the JSON
    types of properties); empty when it fits. Deliberately small: what a malformed call gets wrong."""
    if not isinstance(args, dict):
        return [f"arguments must be a JSON object, got {type(args).__name__}"]
    params = schema.get("parameters") or {}
    props: dict[str, Any] = params.get("properties") or {}
    problems = [f"missing required argument {key!r}" for key in params.get("required", []) if key not in args]
    if props and params.get("additionalProperties", False) is False:
        problems += [
            f"unknown argument {key!r} (known: {', '.join(props)})" for key in args if key not in props
        ]
    checks = {
        "string": str,
        "integer": int,
        "number": (int, float),
        "boolean": bool,
        "array": list,
        "object": dict,
    }
    for key, value in args.items():
        expected = (props.get(key) or {}).get("type")
        kind = checks.get(expected) if isinstance(expected, str) else None
        if kind is None:
            continue
        wrong = not isinstance(value, kind) or (expected in ("integer", "number") and isinstance(value, bool))
        if wrong:
            problems.append(f"argument {key!r} must be {expected}, got {type(value).__name__}")
    return problems
