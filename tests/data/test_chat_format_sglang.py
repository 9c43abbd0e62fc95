"""DeepSeek-V4.1's prompts and tool calls checked by SGLang 0.5.23's own code, in its interpreter: the ids
dsv4rl renders for `data.chat_format=deepseek_v41` (named tiers, integer budgets, thinking off, a tool
block) are those SGLang's `DeepSeekRecipe("dsv41")` encodes for the same request, and the V4.1 DSML call
dsv4rl writes and reads is the call SGLang's `DeepSeekV41Detector` reads, where V4's detector finds none.
Negative control: V4's renderer encodes the same requests differently."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsv4rl.config.choices import ChatFormat, ReasoningEffort
from dsv4rl.data.chat_format import ChatSettings, PromptRenderer
from dsv4rl.rollout.turn_format import DsmlFormat
from sglang_runner import needs_sglang
from v41_tokenizer import dsv41_tokenizer, save_dsv41_tokenizer, tool_call_messages

pytestmark = [*needs_sglang, pytest.mark.slow]

PROBLEM = "What is 6*7?"
SCHEMA = {
    "name": "python",
    "description": "Run Python code and get what it prints.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
}
CASES = [  # (thinking, named tier, integer budget, tools)
    (True, None, None, False),
    (True, ReasoningEffort.low, None, False),
    (True, ReasoningEffort.max, None, False),
    (True, None, 1, False),
    (True, None, 33, False),
    (True, None, 100, False),
    (False, None, None, False),
    (True, None, 60, True),
]


def sglang_body(thinking: bool, effort: ReasoningEffort | None, budget: int | None, tools: bool) -> dict:
    """The chat request SGLang's chat route hands its renderer: an integer budget as `effort_budget`."""
    body: dict = {"messages": [{"role": "user", "content": PROBLEM}], "thinking": thinking}
    if effort is not None:
        body["reasoning_effort"] = effort.value
    if budget is not None:
        body["effort_budget"] = budget
    if tools:
        body["tools"] = [{"type": "function", "function": SCHEMA}]
    return body


def test_sglang_renders_the_v41_prompts_dsv4rl_sends(sglang_sides, tmp_path: Path) -> None:
    tokenizer_json = str(save_dsv41_tokenizer(tmp_path / "tokenizer"))
    tok = dsv41_tokenizer()
    ours = []
    for thinking, effort, budget, tools in CASES:
        settings = ChatSettings(ChatFormat.deepseek_v41, thinking, effort, budget)
        ours.append(PromptRenderer(tok, settings, tools=[SCHEMA] if tools else ()).encode([PROBLEM])[0])
    bodies = [sglang_body(*case) for case in CASES]
    side = sglang_sides.get()
    theirs = side.call("chat_render:encode", tokenizer_json=tokenizer_json, spec="dsv41", bodies=bodies)
    for case, mine, sglang in zip(CASES, ours, theirs, strict=True):
        assert mine == sglang, case
    assert (
        ours[CASES.index((True, None, 100, False))]
        == ours[CASES.index((True, ReasoningEffort.max, None, False))]
    )
    assert (
        len({tuple(ids) for ids in ours}) == len(CASES) - 1
    )  # budget 100 is the max tier; the others differ
    v4 = side.call("chat_render:encode", tokenizer_json=tokenizer_json, spec="dsv4", bodies=bodies[:1])
    assert v4[0] != ours[0]  # negative control: V4's encoding is another prompt


def test_sglang_reads_the_v41_tool_call_dsv4rl_writes_and_parses(sglang_sides) -> None:
    tok = dsv41_tokenizer()
    fmt = DsmlFormat(PromptRenderer(tok, ChatSettings(ChatFormat.deepseek_v41, True), tools=[SCHEMA]))
    messages = tool_call_messages(PROBLEM)
    prompt, rendered = fmt.encode(messages[:1]), fmt.encode(messages)
    turn_ids = rendered[len(prompt) : rendered.index(tok.eos_token_id, len(prompt))]  # EOS off, as SGLang
    after_thinking = tok.decode(turn_ids).split("</think>", 1)[1]  # the detector reads the answer part
    ours = fmt.parse(turn_ids, 0, "stop")
    side = sglang_sides.get()
    theirs = side.call("chat_render:parse_tool_calls", spec="dsv41", text=after_thinking, tools=[SCHEMA])
    assert [{"name": c.name, "arguments": json.loads(c.arguments)} for c in ours.calls] == theirs["calls"]
    assert theirs["calls"] == [{"name": "python", "arguments": {"code": "print(6*7)"}}]
    v4 = side.call("chat_render:parse_tool_calls", spec="dsv4", text=after_thinking, tools=[SCHEMA])
    assert v4["calls"] == []  # negative control: V4's tags are not V4.1's
