"""How a multi-turn conversation is written in tokens, and how an assistant turn's tool calls are read.

A format renders a whole conversation (chat messages) to ids with the chat format's own encoder, parses
the ids of one assistant turn into reasoning, content and tool calls, and says where the rendered
assistant turn ends, so the rollout can take what the template inserts after it (the tool results, the
next turn's opening tokens) as the difference of two renders (`dsv4rl.rollout.trajectory`).

- `DsmlFormat` (`data.chat_format=deepseek_v4`): DeepSeek-V4's own format through deepseek-recipe: the
  tool schemas in the prompt's "## Tools" block, calls as a `<｜DSML｜tool_calls>` block that ends the turn
  with EOS, results folded into the next `<｜User｜>` turn as `<tool_result>` blocks.
- `PlainFormat` (`data.chat_format=none`, the tiny character tokenizer): a turn that ends with `?` is a
  call (`?` stops generation, as EOS ends a DSML call): `argument?` with one tool, `name:argument?` with
  several; its result is written `=<text>` right after it. Small enough for a model that spells one
  character a token.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from dsv4rl.data.chat_format import ChatFormatError, PromptRenderer, user_messages
from dsv4rl.data.problems import Problem

PLAIN_CALL, PLAIN_NAME_END = "?", ":"
PLAIN_RESULT = "="  # then the result's text; the next turn follows at once


@dataclass
class ParsedCall:
    """One tool call read from a turn; `error` says why it is malformed (then it is not run)."""

    id: str
    name: str
    arguments: str  # as the model wrote them (JSON text for DSML)
    args: dict[str, Any] | None = None  # parsed; None when malformed
    error: str | None = None


@dataclass
class AssistantTurn:
    """One assistant turn as the model sampled it: its ids verbatim and what they say."""

    ids: list[int]
    text: str
    content: str
    reasoning: str = ""
    calls: list[ParsedCall] = field(default_factory=list)
    finish_reason: str = "stop"
    parse_error: str | None = None  # the whole call block could not be read

    @classmethod
    def from_message(cls, message: dict[str, Any], tool_names: Sequence[str]) -> AssistantTurn:
        """An OpenAI-style assistant message as a turn (no ids: it was not sampled here): its calls read
        from `tool_calls`, their arguments JSON text or an object."""
        calls = []
        for index, entry in enumerate(message.get("tool_calls") or []):
            function = entry.get("function") or {}
            arguments = function.get("arguments") or ""
            arguments = arguments if isinstance(arguments, str) else json.dumps(arguments)
            call_id = str(entry.get("id") or f"call_{index}")
            calls.append(read_call(call_id, str(function.get("name") or ""), arguments, tool_names))
        content = str(message.get("content") or "")
        reasoning = str(message.get("reasoning_content") or "")
        return cls(ids=[], text=content, content=content, reasoning=reasoning, calls=calls)

    def message(self) -> dict[str, Any]:
        """The turn as an OpenAI-style assistant message (what an environment's `step` receives and what the
        next render is made from); a malformed call's arguments are sent as `{}` to keep it renderable."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        if self.calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments if c.error is None else "{}"},
                }
                for c in self.calls
            ]
        return out


def read_call(call_id: str, name: str, arguments: str, tool_names: Sequence[str]) -> ParsedCall:
    """A call as the model wrote it (a name, JSON arguments): malformed when the tool is unknown or the
    arguments are not JSON (whether they fit the tool's schema is the tool environment's check)."""
    call = ParsedCall(call_id, name, arguments)
    if name not in tool_names:
        call.error = f"unknown tool {name!r}; tools: {', '.join(tool_names)}"
        return call
    try:
        call.args = json.loads(arguments) if arguments.strip() else {}
    except ValueError as error:
        call.error = f"the arguments are not valid JSON ({error}): {arguments[:200]!r}"
    return call


class AssistantMessage(dict):
    """An assistant turn as the message an environment's `step` receives (`AssistantTurn.message`), with
    the turn as the rollout parsed it (`turn`): what the message cannot show (a malformed call's error, a
    call block that could not be read) stays there for the built-in tool environment."""

    def __init__(self, turn: AssistantTurn):
        super().__init__(turn.message())
        self.turn = turn


class TurnFormat(Protocol):
    stop_ids: list[int]  # tokens besides EOS that end a turn (the plain call marker)

    def initial_messages(self, problem: Problem) -> list[dict[str, Any]]: ...

    def encode(self, messages: list[dict[str, Any]]) -> list[int]:
        """The whole conversation, ending with the tokens that open the next assistant turn."""

    def parse(self, ids: list[int], turn_index: int, finish_reason: str) -> AssistantTurn: ...

    def assistant_end(self, rendered: list[int], start: int, turn: AssistantTurn) -> int:
        """Where the assistant turn that starts at `start` of `rendered` ends (what follows is inserted)."""

    def tool_message(self, call_id: str, text: str) -> dict[str, Any]: ...

    def assistant_message(self, turn: AssistantTurn) -> dict[str, Any]:
        """The turn as the message the next render is made from."""

    def count_tokens(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def _call_id(turn_index: int, index: int) -> str:
    return f"call_{turn_index}_{index}"  # deterministic (the encoder's own ids are random)


class _Tokens:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_token_id

    def initial_messages(self, problem: Problem) -> list[dict[str, Any]]:
        """The conversation a trajectory starts from: the problem as one user turn, as the prompt stream
        renders it."""
        return user_messages(problem.prompt)

    def count_tokens(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def without_eos(self, ids: list[int]) -> list[int]:
        return ids[:-1] if ids and ids[-1] == self.eos_id else ids


class PlainFormat(_Tokens):
    """chat_format none: BOS + the user's text, then turns as plain text (see the module doc)."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]]):
        super().__init__(tokenizer)
        self.schemas = {schema["name"]: schema for schema in tools}  # the tools' function schemas
        self.tool_names = list(self.schemas)
        marker = self.count_tokens(PLAIN_CALL)
        self.stop_ids = marker if len(marker) == 1 else []  # the marker ends a turn as EOS ends DSML's

    def _text(self, message: dict[str, Any]) -> str:
        if message["role"] == "tool":
            return f"{PLAIN_RESULT}{message['content']}"
        return str(message.get("content") or "")

    def encode(self, messages: list[dict[str, Any]]) -> list[int]:
        ids = [] if self.tokenizer.bos_token_id is None else [self.tokenizer.bos_token_id]
        for message in messages:
            ids += self.count_tokens(self._text(message))
            if message["role"] == "assistant" and message.get("eos"):
                ids.append(self.eos_id)
        return ids

    def parse(self, ids: list[int], turn_index: int, finish_reason: str) -> AssistantTurn:
        text = self.decode(self.without_eos(ids))
        turn = AssistantTurn(ids=list(ids), text=text, content=text, finish_reason=finish_reason)
        if not text.endswith(PLAIN_CALL):
            return turn
        body = text[: -len(PLAIN_CALL)]
        if len(self.tool_names) == 1:  # one tool: what precedes the marker is its argument
            name, argument = self.tool_names[0], body
        else:
            name, _, argument = body.partition(PLAIN_NAME_END)
        call = ParsedCall(_call_id(turn_index, 0), name, argument)
        if name not in self.tool_names:
            call.error = f"unknown tool {name!r}; tools: {', '.join(self.tool_names)}"
        else:
            call.args = self._args(self.schemas[name], argument)
        turn.calls = [call]
        return turn

    @staticmethod
    def _args(schema: dict[str, Any], argument: str) -> dict[str, Any]:
        """The argument text as the call's arguments: the tool's first string parameter (or `input`)."""
        if not argument:
            return {}
        properties = (schema.get("parameters") or {}).get("properties") or {}
        strings = [key for key, prop in properties.items() if prop.get("type") == "string"]
        return {strings[0] if strings else "input": argument}

    def assistant_end(self, rendered: list[int], start: int, turn: AssistantTurn) -> int:
        return start + len(self.count_tokens(turn.content)) + (1 if turn.ids[-1:] == [self.eos_id] else 0)

    def tool_message(self, call_id: str, text: str) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": call_id, "content": text}

    def assistant_message(self, turn: AssistantTurn) -> dict[str, Any]:
        return {**turn.message(), "eos": turn.ids[-1:] == [self.eos_id]}


class DsmlFormat(_Tokens):
    """data.chat_format=deepseek_v4 or deepseek_v41: rendered and parsed by deepseek-recipe (see the module
    doc); each version's own call tags (V4.1's `<｜DSML｜ calls>`) come from the encoding and parser of its
    model."""

    def __init__(self, renderer: PromptRenderer):
        if not renderer.settings.is_chat:
            raise ChatFormatError("DsmlFormat needs data.chat_format=deepseek_v4 or deepseek_v41")
        super().__init__(renderer.tokenizer)
        self.stop_ids: list[int] = []  # a call block ends with EOS
        self.renderer = renderer
        self.tool_names = [schema["name"] for schema in renderer.tools]

    def encode(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.renderer.encode_messages(messages)

    def parse(self, ids: list[int], turn_index: int, finish_reason: str) -> AssistantTurn:
        body = self.without_eos(ids)
        text = self.decode(ids)
        turn = AssistantTurn(ids=list(ids), text=text, content="", finish_reason=finish_reason)
        try:
            deltas = self._recipe_parse(body)
        except Exception as error:  # the reference parser raises on some malformed output: never fatal
            turn.content = self.decode(body)
            turn.parse_error = f"the tool-call block could not be parsed: {error}"
            return turn
        content, reasoning, calls = [], [], {}
        for delta in deltas:
            content.append(delta.get("content") or "")
            reasoning.append(delta.get("reasoning_content") or "")
            for piece in delta.get("tool_calls") or []:
                entry = calls.setdefault(piece["index"], {"name": "", "arguments": ""})
                function = piece.get("function") or {}
                entry["name"] = function.get("name") or entry["name"]
                entry["arguments"] += function.get("arguments") or ""
        turn.content, turn.reasoning = "".join(content), "".join(reasoning)
        for index in sorted(calls):
            name, arguments = calls[index]["name"], calls[index]["arguments"]
            turn.calls.append(read_call(_call_id(turn_index, index), name, arguments, self.tool_names))
        return turn

    def _recipe_parse(self, ids: list[int]) -> list[dict[str, Any]]:
        renderer = self.renderer
        recipe = renderer.recipe
        stage = recipe.ThinkingInitialStage.ReasoningStart if renderer.settings.starts_in_reasoning else None
        options = recipe.ParsingOptions(
            parse_tool_calls=True, thinking_initial_stage=stage, special_tokens=renderer.special_tokens
        )
        request = recipe.ConversationRequest(recipe.Conversation(), renderer.model_version)
        generator = recipe.ChatCompletionRequest.chunk_generator(request, "", renderer.model_name)
        processor = recipe.StreamProcessor(generator, options, renderer.recipe_tokenizer)
        chunks = processor.push(recipe.InferenceChunk.tokens(ids)) if ids else []
        chunks += processor.push(recipe.InferenceChunk.finish(recipe.InferenceFinishReason.Stop))
        return [json.loads(chunk.to_json())["choices"][0]["delta"] for chunk in chunks]

    def assistant_end(self, rendered: list[int], start: int, turn: AssistantTurn) -> int:
        """A rendered assistant turn followed by anything ends with EOS: just past the first EOS."""
        try:
            return rendered.index(self.eos_id, start) + 1
        except ValueError:
            return len(rendered)

    def tool_message(self, call_id: str, text: str) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": call_id, "content": text}

    def assistant_message(self, turn: AssistantTurn) -> dict[str, Any]:
        return turn.message()


def turn_format(renderer: PromptRenderer) -> PlainFormat | DsmlFormat:
    """The format of the recipe's chat format, for the tools the renderer carries."""
    if renderer.settings.is_chat:
        return DsmlFormat(renderer)
    return PlainFormat(renderer.tokenizer, renderer.tools)
