"""DeepSeek chat prompts and tool calls as SGLang 0.5.23 renders and parses them.

`encode` renders chat request bodies with SGLang's own `DeepSeekRecipe`
(`srt/parser/deepseek_recipe_renderer.py`, the class its chat route encodes prompts with), integer effort
budgets included; `parse_tool_calls` reads a response's text with the DSML detector SGLang serves that
model with (`DeepSeekV41Detector` for "dsv41": the `<｜DSML｜ calls>` tags with their leading space).
"""

from __future__ import annotations

import json
from typing import Any


def encode(tokenizer_json: str, spec: str, bodies: list[dict[str, Any]]) -> list[list[int]]:
    """Each body's prompt ids; a body is `{"messages", "thinking": bool, "tools"?, "reasoning_effort"?,
    "effort_budget"?}` as SGLang's chat route hands it to `DeepSeekRecipe.encode`."""
    from sglang.srt.parser.deepseek_recipe_renderer import DeepSeekRecipe
    from tokenizers import Tokenizer

    recipe = DeepSeekRecipe(spec, Tokenizer.from_file(tokenizer_json))
    out = []
    for body in bodies:
        body = dict(body)
        budget = body.pop("effort_budget", None)
        out.append(list(recipe.encode(body, effort_budget=budget)))
    return out


def parse_tool_calls(spec: str, text: str, tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The calls SGLang's detector for `spec` finds in `text`:
    {"normal_text", "calls": [{"name", "arguments"}]}."""
    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.function_call.deepseekv4_detector import DeepSeekV4Detector
    from sglang.srt.function_call.deepseekv41_detector import DeepSeekV41Detector

    detector = {"dsv4": DeepSeekV4Detector, "dsv41": DeepSeekV41Detector}[spec]()
    result = detector.detect_and_parse(text, [Tool(type="function", function=tool) for tool in tools])
    return {
        "normal_text": result.normal_text,
        "calls": [{"name": call.name, "arguments": json.loads(call.parameters)} for call in result.calls],
    }
