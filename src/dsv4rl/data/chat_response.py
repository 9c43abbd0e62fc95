"""A response split into its reasoning and its answer, by deepseek-recipe's own output parser.

After a thinking prompt (`...<｜Assistant｜><think>`) a DeepSeek-V4 response is reasoning, `</think>`, then
the answer; a response that never closes its thinking (cut off by the token cap, or stopped) has no
answer, and graders must not read its reasoning as one. After a non-thinking prompt the whole response
is the answer. The split is recipe's `StreamProcessor`, fed token ids as SGLang 0.5.23 feeds it
(`srt/parser/deepseek_recipe_output.py`: tool-call parsing off, the matched EOS cut off first): it finds
`</think>` by token id, drops the newlines that open the reasoning and the answer and those that end
the reasoning. Token counts split at the first `</think>` id. With `chat_format=none` nothing
is parsed: the answer is the response text as the engine returned it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dsv4rl.config.choices import ChatFormat
from dsv4rl.data.chat_format import ChatSettings, PromptRenderer

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ResponseParts:
    reasoning: str
    answer: str | None  # None: the thinking never closed, so there is no answer (graded incorrect)
    reasoning_tokens: int
    answer_tokens: int


class ResponseParser:
    """Responses of prompts rendered by `renderer` -> `ResponseParts`."""

    def __init__(self, renderer: PromptRenderer):
        self.settings: ChatSettings = renderer.settings
        self.renderer = renderer
        self.eos_id = renderer.tokenizer.eos_token_id

    def parse(self, response_ids: Sequence[int], response_text: str) -> ResponseParts:
        ids = list(response_ids)
        if ids and self.eos_id is not None and ids[-1] == self.eos_id:
            ids = ids[:-1]  # the stop token, as SGLang cuts a matched stop id before parsing
        if self.settings.format == ChatFormat.none:
            return ResponseParts("", response_text, 0, len(ids))
        thinking = self.settings.starts_in_reasoning
        reasoning, content = self._recipe_parse(ids, thinking)
        if not thinking:
            return ResponseParts("", content, 0, len(ids))
        end_id = self.renderer.token_ids["thinking_end"]
        if end_id not in ids:
            return ResponseParts(reasoning, None, len(ids), 0)
        cut = ids.index(end_id)
        return ResponseParts(reasoning, content, cut, len(ids) - cut - 1)

    def _recipe_parse(self, ids: list[int], thinking: bool) -> tuple[str, str]:
        recipe = self.renderer.recipe
        stage = recipe.ThinkingInitialStage.ReasoningStart if thinking else None
        options = recipe.ParsingOptions(
            parse_tool_calls=False,
            thinking_initial_stage=stage,
            special_tokens=self.renderer.special_tokens,
        )
        request = recipe.ConversationRequest(recipe.Conversation(), self.renderer.model_version)
        generator = recipe.ChatCompletionRequest.chunk_generator(request, "", self.renderer.model_name)
        processor = recipe.StreamProcessor(generator, options, self.renderer.recipe_tokenizer)
        chunks = processor.push(recipe.InferenceChunk.tokens(ids)) if ids else []
        chunks += processor.push(recipe.InferenceChunk.finish(recipe.InferenceFinishReason.Stop))
        reasoning, content = [], []
        for chunk in chunks:
            delta: dict[str, Any] = json.loads(chunk.to_json())["choices"][0]["delta"]
            reasoning.append(delta.get("reasoning_content") or "")
            content.append(delta.get("content") or "")
        return "".join(reasoning), "".join(content)


def split_saved_response(text: str) -> tuple[str, str]:
    """(reasoning, answer) of a saved response's text, by the rule SGLang 0.5.23 applies to a whole output
    (`srt/parser/deepseek_recipe_output.py: parse_output_text`, thinking unknown): text that closes a
    thinking block is reasoning up to `</think>`, otherwise it is all answer; newlines are dropped as
    deepseek-recipe's parser drops them (and a second `</think>`). Text alone cannot show a cut-off
    thinking block."""
    if text.startswith(THINK_START):
        text = text[len(THINK_START) :]
    if THINK_END not in text:
        return "", text
    reasoning, answer = text.split(THINK_END, 1)
    return reasoning.strip("\n"), answer.lstrip("\n").replace(THINK_END, "")  # recipe drops a later one


def response_split_metrics(parts: Sequence[ResponseParts], prefix: str = "") -> dict[str, float]:
    """`no_answer_fraction` (thinking never closed), `reasoning_len_mean` and `answer_len_mean` (tokens)."""
    n = max(len(parts), 1)
    return {
        f"{prefix}no_answer_fraction": sum(p.answer is None for p in parts) / n,
        f"{prefix}reasoning_len_mean": sum(p.reasoning_tokens for p in parts) / n,
        f"{prefix}answer_len_mean": sum(p.answer_tokens for p in parts) / n,
    }
