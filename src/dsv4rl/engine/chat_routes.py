"""`POST /v1/chat/completions` on the reference engine: SGLang's OpenAI-compatible chat route, the fields a
judge uses (`CHAT_FIELDS`, each one of SGLang's `ChatCompletionRequest`, checked in the contract tests).

The messages are rendered by DeepSeek-V4's chat encoding (deepseek-recipe, as SGLang's "dsv4" encoder
does), with thinking off unless `chat_template_kwargs.thinking` is true; the reply's reasoning is split
from its content as SGLang's reasoning parser splits it (`separate_reasoning`). On CPU this lets a run use
the tiny model as its own judge (`reward.judge.base_url` = the engine's URL). Not served: streaming, tools,
logprobs, n > 1 (a 400 names the field).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from dsv4rl.config.choices import ChatFormat
from dsv4rl.data.chat_format import ChatFormatError, ChatSettings, PromptRenderer
from dsv4rl.data.chat_response import ResponseParser
from dsv4rl.engine.generator import GenRequest
from dsv4rl.engine.http_util import BadRequest
from dsv4rl.engine.protocol import RangeError
from dsv4rl.engine.sampling import SamplingParams

router = APIRouter()

# The ChatCompletionRequest fields the reference engine reads (others are accepted and ignored, as long as
# they ask for nothing it cannot do: `UNSERVED`).
CHAT_FIELDS = (
    "messages", "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
    "stop", "separate_reasoning", "chat_template_kwargs", "skip_special_tokens", "stream", "n", "logprobs",
    "tools",
)  # fmt: skip
UNSERVED = {"stream": False, "n": 1, "logprobs": False, "tools": None}
DEFAULT_MAX_TOKENS = 128


def _renderer(engine: Any, thinking: bool) -> PromptRenderer:
    cache = engine.__dict__.setdefault("_chat_renderers", {})
    if thinking not in cache:
        if engine.tokenizer is None:
            raise BadRequest("chat completions need a tokenizer (the engine runs with skip_tokenizer_init)")
        try:
            cache[thinking] = PromptRenderer(engine.tokenizer, ChatSettings(ChatFormat.deepseek_v4, thinking))
        except ChatFormatError as error:
            raise BadRequest(f"the model's tokenizer cannot render DeepSeek-V4 chats: {error}") from None
    return cache[thinking]


def parse_chat(body: Any) -> tuple[list[dict], SamplingParams, bool, bool]:
    """(messages, sampling params, thinking, separate_reasoning) of a chat completion request."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise BadRequest("messages must be a non-empty list of {role, content} objects")
    for key, plain in UNSERVED.items():
        if body.get(key) not in (None, plain):
            raise BadRequest(f"{key}={body[key]!r} is not supported by the dsv4rl reference engine")
    limit = body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_MAX_TOKENS
    stop = body.get("stop") or []
    temperature = body.get("temperature")
    params = SamplingParams(
        max_new_tokens=int(limit),
        temperature=1.0 if temperature is None else float(temperature),
        top_p=float(body.get("top_p") or 1.0),
        top_k=int(body["top_k"]) if body.get("top_k") is not None else -1,
        stop=[stop] if isinstance(stop, str) else list(stop),
        skip_special_tokens=bool(body.get("skip_special_tokens", True)),
        sampling_seed=body.get("seed"),
    )
    if params.max_new_tokens < 1 or params.temperature < 0:
        raise RangeError("max_completion_tokens must be >= 1 and temperature >= 0")
    kwargs = body.get("chat_template_kwargs") or {}
    return messages, params, bool(kwargs.get("thinking", False)), bool(body.get("separate_reasoning", True))


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> JSONResponse:
    engine = request.app.state.engine
    try:
        body = await request.json()
    except ValueError as error:
        raise BadRequest(f"invalid JSON body: {error}") from None
    messages, params, thinking, separate = parse_chat(body)
    renderer = _renderer(engine, thinking)
    try:
        prompt = renderer.encode_messages(messages)
    except ChatFormatError as error:
        raise BadRequest(str(error)) from None
    params.max_new_tokens = min(params.max_new_tokens, engine.context_length - len(prompt))
    if params.max_new_tokens < 1:
        raise RangeError(
            f"the chat ({len(prompt)} tokens) fills the model's context ({engine.context_length})"
        )
    item = GenRequest(input_ids=prompt, params=params, rid=uuid.uuid4().hex)
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    item.listeners.append(lambda: loop.call_soon_threadsafe(done.set) if item.finished else None)
    try:
        engine.generator.submit([item])
    except ValueError as error:
        raise RangeError(str(error)) from error
    try:
        await done.wait()
    finally:
        if not item.finished:
            engine.generator.abort(item.rid)
    reason = item.finish_reason or {}
    text = engine.decode(list(item.output_ids), params.skip_special_tokens)
    reasoning = None
    if separate:
        parts = ResponseParser(renderer).parse(item.output_ids, text)
        reasoning, text = (parts.reasoning or None), (parts.answer or "")
    finish = (
        "length" if reason.get("type") == "length" else "stop" if reason.get("type") == "stop" else "abort"
    )
    answer = {
        "id": f"chatcmpl-{item.rid}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model") or engine.args.served_model_name or engine.args.model_path,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": text,
                    "reasoning_content": reasoning,
                    "tool_calls": None,
                },
                "logprobs": None,
                "finish_reason": finish,
                "matched_stop": reason.get("matched"),
            }
        ],
        "usage": {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(item.output_ids),
            "total_tokens": len(prompt) + len(item.output_ids),
        },
    }
    return JSONResponse(answer)
