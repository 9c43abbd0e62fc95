"""`rollout.tools` loaded: builtins, a user's class or function in a file (its schema derived from the
signature and docstring), every mistake reported with its fix, and the arguments check of a call."""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path

import pytest

from dsv4rl.config.schema import ToolConfig
from dsv4rl.data.problems import Problem
from dsv4rl.targets import TargetError
from dsv4rl.tools.base import FunctionTool, Tool, function_schema, schema_problems
from dsv4rl.tools.loading import build_tool, build_tools, tool_problems
from dsv4rl.tools.lookup import LookupTool
from dsv4rl.tools.python_tool import PythonTool

USER_TOOLS = '''
from __future__ import annotations

from dsv4rl.tools.base import ToolResult

VALUE = 3

SCHEMA = {"name": "counter", "description": "Count.", "parameters": {"type": "object", "properties": {}}}


class Counter:
    name = "counter"

    def __init__(self, start: int = 0):
        self.start = start
        self.schema = dict(SCHEMA)

    async def open(self, problem):
        return {"n": self.start}

    async def call(self, state, args):
        state["n"] += 1
        return ToolResult(text=str(state["n"]))

    async def close(self, state):
        return None


class SyncMethods:
    name = "sync"
    schema = SCHEMA

    def open(self, problem):
        return None

    async def call(self, state, args):
        return "x"

    def close(self, state):
        return None


class NoName:
    schema = SCHEMA

    async def open(self, problem):
        return None

    async def call(self, state, args):
        return "x"

    async def close(self, state):
        return None


class OtherSchemaName(NoName):
    name = "count"


class NoSchemaName(NoName):
    name = "count"
    schema = {"description": "Count.", "parameters": {"type": "object", "properties": {}}}


class NeedsSandbox(Counter):
    def __init__(self):
        raise OSError("no sandbox here")


def weather(city: str, days: int = 1, metric: bool | None = True, tags: list[str] | None = None) -> str:
    """Get the forecast
    for a city.

    Longer notes that are not the description.

    Args:
        city: The city's name.
        days (int): How many days ahead.
    """
    return f"{city}:{days}"


async def shout(text: str) -> dict:
    """Say it louder."""
    return {"text": text + "!", "reward": 0.5}
'''


@pytest.fixture
def base(tmp_path: Path) -> Path:
    (tmp_path / "user_tools.py").write_text(textwrap.dedent(USER_TOOLS))
    return tmp_path


def one(target: str, base: Path, **entry) -> Tool:
    return build_tool(ToolConfig(target=target, **entry), [base])


def error_of(entries: list[ToolConfig], base: Path) -> str:
    with pytest.raises(TargetError) as caught:
        build_tools(entries, [base])
    problems = tool_problems(entries, [base])
    assert problems == [str(caught.value)]  # validation reports what building raises
    return str(caught.value)


# --- what loads ---------------------------------------------------------------------------------------------


def test_builtin_python_with_kwargs(base):
    tool = one("builtin:python", base, kwargs={"timeout_s": 3, "isolation": "auto"})
    assert isinstance(tool, PythonTool) and isinstance(tool, Tool)
    assert tool.name == "python" and tool.schema["name"] == "python"
    assert tool.timeout_s == 3.0 and "3 s" in tool.schema["description"]


def test_untrusted_rlimits_is_refused_at_validation_with_the_fix(base):
    entry = ToolConfig(target="builtin:python", kwargs={"isolation": "rlimits"})
    message = error_of([entry], base)
    assert "isolation=rlimits" in message and "trust_model_code: true" in message


def test_builtin_lookup_renamed(base):
    tool = one("builtin:lookup", base, name="peek", kwargs={"column": "hidden"})
    assert isinstance(tool, LookupTool)
    assert tool.name == "peek" and tool.schema["name"] == "peek"
    assert LookupTool().name == "lookup"  # the rename is the instance's, not the class's

    async def go():
        state = await tool.open(Problem("Q:", "1", "p", metadata={"hidden": "7"}))
        return (await tool.call(state, {})).text

    assert asyncio.run(go()) == "7"


def test_class_in_a_file_built_with_kwargs(base):
    tool = one("user_tools.py:Counter", base, kwargs={"start": 5})
    assert tool.name == "counter" and tool.schema["name"] == "counter"

    async def go():
        state = await tool.open(None)
        return [(await tool.call(state, {})).text for _ in range(2)]

    assert asyncio.run(go()) == ["6", "7"]


def test_function_in_a_file_schema_from_signature_and_docstring(base):
    tool = one("user_tools.py:weather", base)
    assert isinstance(tool, FunctionTool) and tool.name == "weather"
    assert tool.schema == {
        "name": "weather",
        "description": "Get the forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city's name."},
                "days": {"type": "integer", "description": "How many days ahead."},
                "metric": {"type": "boolean"},
                "tags": {"type": "array"},
            },
            "required": ["city"],
        },
    }
    result = asyncio.run(tool.call(None, {"city": "Oslo", "days": 2}))
    assert result.text == "Oslo:2" and not result.error


def test_async_function_tool_renamed_returns_a_reward(base):
    tool = one("user_tools.py:shout", base, name="yell")
    assert tool.name == "yell" and tool.schema["name"] == "yell"
    assert tool.schema["parameters"]["required"] == ["text"]
    result = asyncio.run(tool.call(None, {"text": "hi"}))
    assert (result.text, result.reward) == ("hi!", 0.5)


def test_schema_of_a_function_without_docstring():
    def add(a: int, b: float = 1.0, *rest, **more):
        return a + b

    schema = function_schema(add)
    assert schema["description"] == ""
    assert schema["parameters"]["properties"] == {"a": {"type": "integer"}, "b": {"type": "number"}}
    assert schema["parameters"]["required"] == ["a"]


def test_a_schema_without_a_name_gets_the_tools(base):
    tool = one("user_tools.py:NoSchemaName", base)
    assert tool.schema["name"] == "count" == tool.name


def test_several_tools_and_a_clean_validation(base):
    entries = [
        ToolConfig(target="builtin:lookup"),
        ToolConfig(target="builtin:lookup", name="peek"),
        ToolConfig(target="user_tools.py:weather"),
        ToolConfig(target=str(base / "user_tools.py") + ":Counter"),  # an absolute path
    ]
    assert [t.name for t in build_tools(entries, [base])] == ["lookup", "peek", "weather", "counter"]
    assert tool_problems(entries, [base]) == []


# --- what does not, each with its fix -----------------------------------------------------------------------


def test_unknown_builtin(base):
    message = error_of([ToolConfig(target="builtin:shell")], base)
    assert "no builtin tool 'shell'" in message
    assert "choose one of builtin:python, builtin:lookup" in message


def test_missing_class(base):
    message = error_of([ToolConfig(target="user_tools.py:Calculator")], base)
    assert "has no class or function 'Calculator'" in message and "fix the name after the colon" in message


def test_missing_file(base):
    message = error_of([ToolConfig(target="nowhere.py:Tool")], base)
    assert "not found" in message and "relative to the recipe's directory" in message


def test_missing_module(base):
    message = error_of([ToolConfig(target="no_such_pkg.tools:Tool")], base)
    assert "no module 'no_such_pkg'" in message and "PYTHONPATH" in message


def test_class_without_async_methods(base):
    message = error_of([ToolConfig(target="user_tools.py:SyncMethods")], base)
    assert "SyncMethods is not a dsv4rl tool" in message
    assert "['open', 'close']" in message
    assert "dsv4rl.tools.base.Tool, or give a plain function" in message


def test_class_without_a_name(base):
    message = error_of([ToolConfig(target="user_tools.py:NoName")], base)
    assert "NoName is not a dsv4rl tool" in message and "['name']" in message
    assert one("user_tools.py:NoName", base, name="named").name == "named"  # an entry's name is enough


def test_class_whose_schema_names_another_tool(base):
    message = error_of([ToolConfig(target="user_tools.py:OtherSchemaName")], base)
    assert "name is 'count' but its schema's name is 'counter'" in message
    assert "make them equal, or give the entry a `name`" in message
    assert one("user_tools.py:OtherSchemaName", base, name="count").schema["name"] == "count"


def test_class_with_wrong_kwargs(base):
    message = error_of([ToolConfig(target="user_tools.py:Counter", kwargs={"begin": 1})], base)
    assert (
        "Counter: unknown keyword argument 'begin' (it takes start): drop it from the recipe's kwargs"
        in message
    )
    misspelled = error_of([ToolConfig(target="user_tools.py:Counter", kwargs={"strat": 1})], base)
    assert "unknown keyword argument 'strat'; did you mean 'start'? (it takes start)" in misspelled
    assert "fix the spelling in the recipe's kwargs" in misspelled


def test_class_whose_constructor_raises(base):
    message = error_of([ToolConfig(target="user_tools.py:NeedsSandbox")], base)
    assert "NeedsSandbox(**{}) raised OSError('no sandbox here')" in message


def test_builtin_with_a_bad_kwarg_value(base):
    message = error_of([ToolConfig(target="builtin:python", kwargs={"isolation": "docker"})], base)
    assert (
        "isolation='docker' is unknown; choose one of auto, namespaces, landlock, remote, rlimits" in message
    )
    assert "builtin:python" in message


def test_function_with_kwargs(base):
    message = error_of([ToolConfig(target="user_tools.py:weather", kwargs={"units": "C"})], base)
    assert "a function tool takes no kwargs (got ['units'])" in message and "drop kwargs" in message


def test_neither_class_nor_function(base):
    message = error_of([ToolConfig(target="user_tools.py:VALUE")], base)
    assert "neither a class nor a function" in message


def test_duplicate_names(base):
    entries = [ToolConfig(target="builtin:lookup"), ToolConfig(target="user_tools.py:weather", name="lookup")]
    message = error_of(entries, base)
    assert "two tools named ['lookup']" in message and "give one a `name`" in message


def test_tool_problems_checks_entries_first(base):
    entries = [ToolConfig(target=""), ToolConfig(target="builtin:lookup", timeout_s=0)]
    assert tool_problems(entries, [base]) == [
        "rollout.tools[0].target is empty; e.g. builtin:python",
        "rollout.tools[1].timeout_s must be > 0 (got 0)",
    ]


# --- schema_problems: what a call's arguments get wrong -----------------------------------------------------

SCHEMA = {
    "name": "f",
    "parameters": {
        "type": "object",
        "properties": {
            "code": {"type": "string"},
            "n": {"type": "integer"},
            "x": {"type": "number"},
            "flag": {"type": "boolean"},
            "items": {"type": "array"},
            "opts": {"type": "object"},
            "anything": {},
        },
        "required": ["code"],
    },
}


@pytest.mark.parametrize(
    ("args", "problems"),
    [
        ({"code": "1"}, []),
        ({"code": "1", "n": 2, "x": 2, "flag": False, "items": [], "opts": {}, "anything": None}, []),
        ({"code": "1", "x": 2.5}, []),
        ({}, ["missing required argument 'code'"]),
        ({"code": 1}, ["argument 'code' must be string, got int"]),
        ({"code": "1", "n": True}, ["argument 'n' must be integer, got bool"]),
        ({"code": "1", "n": 1.5}, ["argument 'n' must be integer, got float"]),
        ({"code": "1", "x": False}, ["argument 'x' must be number, got bool"]),
        ({"code": "1", "items": "a"}, ["argument 'items' must be array, got str"]),
        ({"code": "1", "opts": []}, ["argument 'opts' must be object, got list"]),
        (
            {"code": "1", "extra": 1},
            ["unknown argument 'extra' (known: code, n, x, flag, items, opts, anything)"],
        ),
        (["code"], ["arguments must be a JSON object, got list"]),
        (None, ["arguments must be a JSON object, got NoneType"]),
    ],
)
def test_schema_problems(args, problems):
    assert schema_problems(SCHEMA, args) == problems


def test_schema_problems_open_and_empty_schemas():
    open_schema = {"parameters": {**SCHEMA["parameters"], "additionalProperties": True}}
    assert schema_problems(open_schema, {"code": "1", "extra": 1}) == []
    assert schema_problems({"name": "g"}, {"whatever": 1}) == []
    several = schema_problems(SCHEMA, {"n": "2", "extra": 1})
    assert several == [
        "missing required argument 'code'",
        "unknown argument 'extra' (known: code, n, x, flag, items, opts, anything)",
        "argument 'n' must be integer, got str",
    ]


def test_a_function_tool_may_take_the_data_row_and_a_state_the_model_never_sees():
    from dsv4rl.data.problems import Problem
    from dsv4rl.tools.lookup import LookupTool

    def guess(number: int, problem, state: dict) -> str:
        """Say whether `number` is the answer.

        Args:
            number: The guess.
        """
        state["tries"] = state.get("tries", 0) + 1
        verdict = "right" if str(number) == problem.answer else "wrong"
        return f"{verdict} (try {state['tries']})"

    tool = FunctionTool(guess)
    assert tool.schema["parameters"]["properties"] == {
        "number": {"type": "integer", "description": "The guess."}
    }
    assert tool.schema["parameters"]["required"] == ["number"]
    row = Problem("3+4=", "7", "p1", metadata={"secret": "7"})

    async def go() -> list[str]:
        first, second = await tool.open(row), await tool.open(Problem("1+1=", "2", "p2"))
        said = [(await tool.call(first, {"number": 5})).text, (await tool.call(first, {"number": 7})).text]
        # the model cannot set the context: its `problem` argument is replaced by the row
        said.append((await tool.call(second, {"number": 2, "problem": row})).text)
        return said

    assert asyncio.run(go()) == ["wrong (try 1)", "right (try 2)", "right (try 1)"]

    def lookup(problem) -> str:  # the tiny tool task's tool, written as a function
        """Look up the hidden value of this problem."""
        return problem.metadata.get("secret", problem.answer)

    async def both() -> tuple[str, str]:
        as_function, builtin = FunctionTool(lookup), LookupTool()
        return (
            (await as_function.call(await as_function.open(row), {})).text,
            (await builtin.call(await builtin.open(row), {})).text,
        )

    assert asyncio.run(both()) == ("7", "7")
    assert FunctionTool(lookup).schema["parameters"]["properties"] == {}
