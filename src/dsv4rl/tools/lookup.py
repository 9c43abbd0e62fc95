"""`builtin:lookup`: answers with a column of the trajectory's data row. The tool of the `tiny_tool`
recipe, whose prompts do not say the answer: a model scores only by calling it and copying what it says."""

from __future__ import annotations

from typing import Any

from dsv4rl.data.problems import Problem
from dsv4rl.tools.base import ToolResult


class LookupTool:
    name = "lookup"

    def __init__(self, column: str = "secret"):
        self.column = column
        self.schema = {
            "name": self.name,
            "description": f"Look up the hidden value ({column}) of this problem.",
            "parameters": {"type": "object", "properties": {}, "required": [], "additionalProperties": True},
        }

    async def open(self, problem: Problem) -> Any:
        return problem.metadata.get(self.column, problem.answer)

    async def call(self, state: Any, args: dict[str, Any]) -> ToolResult:
        return ToolResult(text=str(state))

    async def close(self, state: Any) -> None:
        return None
