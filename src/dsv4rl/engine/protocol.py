"""The /generate request schema and response shape of SGLang 0.5.23 (`srt/managers/io_struct.py`,
`sglang/api/v1/api_types.py`), without HTTP.

Two error kinds mirror SGLang's: `ContractError` (schema violations: unknown sampling key, wrong JSON
type, malformed input) becomes 400 {"error": "<string>"}; `RangeError` (a value out of range, an input
too long) becomes 400 {"error": {"message": ...}}.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from dsv4rl.engine.capture import ChoiceCapture
from dsv4rl.engine.generator import GenRequest
from dsv4rl.engine.sampling import TOP_K_ALL, SamplingParams


class ContractError(Exception):
    """A /generate body that breaks the schema: HTTP 400 {"error": message}."""


class RangeError(ValueError):
    """A well-typed value that is not allowed: HTTP 400 {"error": {"message": message}}."""


# Every key SGLang's schema accepts, with its JSON type (serde names, as in SGLang's messages).
SAMPLING_KEYS: dict[str, str] = {
    "max_new_tokens": "i64",
    "stop": "str_or_list",
    "stop_token_ids": "int_list",
    "stop_regex": "str_or_list",
    "temperature": "f64",
    "top_p": "f64",
    "top_k": "i64",
    "min_p": "f64",
    "frequency_penalty": "f64",
    "presence_penalty": "f64",
    "repetition_penalty": "f64",
    "min_new_tokens": "i64",
    "n": "i64",
    "json_schema": "str",
    "regex": "str",
    "ebnf": "str",
    "structural_tag": "str",
    "choice": "str_or_list",
    "ignore_eos": "bool",
    "skip_special_tokens": "bool",
    "spaces_between_special_tokens": "bool",
    "no_stop_trim": "bool",
    "custom_params": "any",
    "stream_interval": "i64",
    "logit_bias": "bias_map",
    "sampling_seed": "i64",
    "beam_width": "i64",
    "watermark": "any",
}
_UNSUPPORTED = ("json_schema", "regex", "ebnf", "structural_tag", "choice")


def _describe(value: Any) -> str:
    if isinstance(value, bool):
        return f"boolean `{str(value).lower()}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value}`"
    if isinstance(value, str):
        return f'string "{value}"'
    if isinstance(value, list):
        return "sequence"
    if isinstance(value, dict):
        return "map"
    return "null"


def _type_error(value: Any, expected: str) -> ContractError:
    return ContractError(f"invalid type: {_describe(value)}, expected {expected}")


def _i64(value: Any) -> int:
    if type(value) is not int:  # bool is a subclass of int: excluded too
        raise _type_error(value, "i64")
    return value


def _f64(value: Any) -> float:
    kind = type(value)
    if kind is float:
        return value
    if kind is not int:
        raise _type_error(value, "f64")
    return float(value)


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise _type_error(value, "a boolean")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise _type_error(value, "a string")
    return value


def _str_or_list(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise _type_error(value, "a string or a sequence of strings")


def _int_list(value: Any) -> list[int]:
    if not isinstance(value, list):
        raise _type_error(value, "a sequence")
    for item in value:
        if type(item) is not int:
            raise _type_error(item, "i64")
    return list(value)


def _bias_map(value: Any) -> dict[int, float]:
    if not isinstance(value, dict):
        raise _type_error(value, "a map")
    out = {}
    for token, bias in value.items():
        if not (isinstance(bias, int | float) and not isinstance(bias, bool)):
            raise _type_error(bias, "f64")
        try:
            out[int(token)] = float(bias)
        except ValueError as error:
            raise RangeError(f"logit_bias keys must be token ids, got {token!r}") from error
    return out


_KIND_CHECKERS: dict[str, Callable[[Any], Any]] = {
    "i64": _i64,
    "f64": _f64,
    "bool": _bool,
    "str": _str,
    "str_or_list": _str_or_list,
    "int_list": _int_list,
    "bias_map": _bias_map,
    "any": lambda value: value,
}
# The checker of each key: a batch of 512 seeded items checks 3600 values, so each check is one call
# and a type test.
_CHECKERS = {key: _KIND_CHECKERS[kind] for key, kind in SAMPLING_KEYS.items()}
# The keys SamplingParams takes as they are (top_k is interpreted below)
_PARAM_FIELDS = frozenset(f.name for f in fields(SamplingParams)) - {"top_k"}


def parse_sampling_params(raw: Any) -> tuple[SamplingParams, int]:
    """Strict key and type check, then SGLang's range checks; returns (params, n)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise _type_error(raw, "struct SamplingParams")
    values = {}
    for key, value in raw.items():
        check = _CHECKERS.get(key)
        if check is None:
            expected = ", ".join(f"`{k}`" for k in SAMPLING_KEYS)
            raise ContractError(f"unknown field `{key}`, expected one of {expected}")
        if value is not None:
            values[key] = check(value)
    for key in _UNSUPPORTED:
        if key in values:
            raise RangeError(f"{key} (constrained decoding) is not supported by the dsv4rl reference engine")
    params = SamplingParams(**{key: value for key, value in values.items() if key in _PARAM_FIELDS})
    top_k = values.get("top_k", -1)
    n = values.get("n", 1)
    if not math.isfinite(params.temperature) or params.temperature < 0.0:
        raise RangeError(f"temperature must be non-negative, got {params.temperature}.")
    if not 0.0 < params.top_p <= 1.0:
        raise RangeError(f"top_p must be in (0, 1], got {params.top_p}.")
    if not 0.0 <= params.min_p <= 1.0:
        raise RangeError(f"min_p must be in [0, 1], got {params.min_p}.")
    if top_k < 1 and top_k != -1:
        raise RangeError(f"top_k must be -1 (disable), or at least 1, got {top_k}.")
    params.top_k = TOP_K_ALL if top_k == -1 else top_k
    if not -2.0 <= params.frequency_penalty <= 2.0:
        raise RangeError(f"frequency_penalty must be in [-2, 2], got {params.frequency_penalty}.")
    if not -2.0 <= params.presence_penalty <= 2.0:
        raise RangeError(f"presence_penalty must be in [-2, 2], got {params.presence_penalty}.")
    if not 0.0 < params.repetition_penalty <= 2.0:
        raise RangeError(f"repetition_penalty must be in (0, 2], got {params.repetition_penalty}.")
    if params.max_new_tokens < 0:
        raise RangeError(f"max_new_tokens must be at least 0, got {params.max_new_tokens}.")
    if not 0 <= params.min_new_tokens <= max(params.max_new_tokens, 0):
        raise RangeError(
            f"min_new_tokens must be in [0, max_new_tokens({params.max_new_tokens})], "
            f"got {params.min_new_tokens}."
        )
    if len(params.stop) > 32:
        raise RangeError(f"stop accepts at most 32 strings, got {len(params.stop)}.")
    if n < 1:
        raise RangeError(f"n must be at least 1, got {n}.")
    if params.greedy:
        params.top_k = 1
    return params, n


@dataclass
class GenerateCall:
    """A parsed /generate body: the expanded sequences and how to shape the answer."""

    requests: list[GenRequest]
    batched: bool  # answer with a JSON array
    stream: bool
    return_prompt_token_ids: bool


def _per_item(value: Any, count: int, name: str, allow_list: bool = True) -> list:
    if isinstance(value, list):
        if not allow_list:
            raise ContractError(f"{name} must not be a list when n > 1")
        if len(value) != count:
            raise ContractError(f"{name} has {len(value)} entries for a batch of {count}")
        return value
    return [value] * count


def _token_ids(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not value:
        raise ContractError(f"{what} must be a non-empty list of token ids")
    for token in value:
        if not isinstance(token, int) or isinstance(token, bool):
            raise _type_error(token, "i64")
    return value


def parse_generate(
    body: Any,
    *,
    encode: Callable[[str], list[int]] | None,
    vocab_size: int,
    context_length: int,
) -> GenerateCall:
    """Validate a /generate body and expand it into one GenRequest per sequence (prompt-major for n>1)."""
    if not isinstance(body, dict):
        raise ContractError("the request body must be a JSON object")
    if body.get("input_embeds") is not None:
        raise RangeError("input_embeds is not supported by the dsv4rl reference engine")
    for key in ("top_logprobs_num", "token_ids_logprob", "return_hidden_states"):
        value = body.get(key)
        if value and (not isinstance(value, list) or any(value)):
            raise RangeError(f"{key} is not supported by the dsv4rl reference engine")
    input_ids, text = body.get("input_ids"), body.get("text")
    if input_ids is not None:
        if not isinstance(input_ids, list) or not input_ids:
            raise ContractError("input_ids must be a non-empty list of ints or a list of lists")
        batched = isinstance(input_ids[0], list)
        prompts = (
            [_token_ids(p, "each input_ids item") for p in input_ids]
            if batched
            else [_token_ids(input_ids, "input_ids")]
        )
    elif text is not None:
        if encode is None:
            raise ContractError("text input needs a tokenizer; send input_ids (skip_tokenizer_init is on)")
        batched = isinstance(text, list)
        texts = text if batched else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise ContractError("text must be a string or a non-empty list of strings")
        prompts = [encode(t) for t in texts]
    else:
        raise ContractError("Either text, input_ids or input_embeds should be provided.")
    count = len(prompts)
    raw_params = body.get("sampling_params") or {}
    if isinstance(raw_params, list):
        if len(raw_params) != count:
            raise ContractError(f"sampling_params has {len(raw_params)} entries for a batch of {count}")
        parsed = [parse_sampling_params(p) for p in raw_params]
    else:
        parsed = [parse_sampling_params(raw_params)] * count
    own_params = isinstance(raw_params, list) and parsed[0][1] == 1  # one sequence per parsed params
    ns = {n for _, n in parsed}
    if len(ns) > 1:
        raise ContractError("The parallel_sample_num (n) should be the same for all samples in a batch.")
    n = ns.pop()
    return_logprob = _per_item(body.get("return_logprob", False) or False, count, "return_logprob", n == 1)
    start_len = _per_item(body.get("logprob_start_len", -1), count, "logprob_start_len", n == 1)
    for flag in return_logprob:
        if not isinstance(flag, bool):
            raise _type_error(flag, "a boolean")
    for start in start_len:
        if not isinstance(start, int) or isinstance(start, bool):
            raise _type_error(start, "i64")
    routed, routed_start, indexer = _capture_fields(body)
    rid = body.get("rid")
    if n == 1 and isinstance(rid, list):
        if not batched or len(rid) != count:
            raise ContractError("rid must be a string or a list with one entry per batch item")
        rids = [str(r) for r in rid]
    elif n == 1 and isinstance(rid, str):
        rids = [f"{rid}_{i}" for i in range(count)] if batched else [rid]
    else:  # n > 1: every sample gets a fresh uuid rid, as in SGLang
        rids = [uuid.uuid4().hex for _ in range(count)]
    requests: list[GenRequest] = []
    for index, prompt in enumerate(prompts):
        if not prompt:
            raise ContractError("the prompt is empty after tokenization")
        if any(t < 0 or t >= vocab_size for t in prompt):
            raise RangeError(f"input_ids contain token ids outside the vocabulary [0, {vocab_size})")
        if len(prompt) >= context_length:
            raise RangeError(
                f"The input ({len(prompt)} tokens) is longer than the model's context length "
                f"({context_length} tokens)."
            )
        if start_len[index] > len(prompt):
            raise RangeError(
                f"logprob_start_len ({start_len[index]}) is greater than the number of input tokens "
                f"({len(prompt)})."
            )
        if routed and routed_start > len(prompt):
            raise RangeError(
                f"recv_req.routed_experts_start_len={routed_start} is higher than the number of input tokens "
                f"len(req.origin_input_ids)={len(prompt)}. Please use a smaller routed_experts_start_len."
            )
        params, _ = parsed[index]
        for _ in range(n):
            sample = params if own_params else SamplingParams(**vars(params))
            sample.max_new_tokens = min(sample.max_new_tokens, context_length - len(prompt))
            requests.append(
                GenRequest(
                    input_ids=list(prompt),
                    params=sample,
                    rid=rids[index] if n == 1 else uuid.uuid4().hex,
                    return_logprob=bool(return_logprob[index]),
                    logprob_start_len=start_len[index],
                    return_routed_experts=routed,
                    routed_experts_start_len=routed_start,
                    return_indexer_topk=indexer,
                )
            )
    return GenerateCall(
        requests=requests,
        batched=batched or n > 1,
        stream=bool(body.get("stream", False)),
        return_prompt_token_ids=bool(body.get("return_prompt_token_ids", False)),
    )


def _capture_fields(body: dict) -> tuple[bool, int, bool]:
    """return_routed_experts, routed_experts_start_len, return_indexer_topk: one value for the whole
    request (SGLang's GenerateReqInput, srt/managers/io_struct.py:264-269), the start checked as SGLang's
    scheduler does (srt/managers/scheduler.py:3300-3313)."""
    routed = body.get("return_routed_experts")
    start = body.get("routed_experts_start_len")
    indexer = body.get("return_indexer_topk")
    routed = False if routed is None else _bool(routed)
    start = 0 if start is None else _i64(start)
    indexer = False if indexer is None else _bool(indexer)
    if routed and start < 0:
        raise RangeError(
            f"recv_req.routed_experts_start_len={start} is lower than 0. "
            "Please use a non-negative routed_experts_start_len."
        )
    return routed, start, indexer


def _output_text(request: GenRequest, decode: Callable[[list[int], bool], str]) -> str:
    params, reason = request.params, request.finish_reason or {}
    ids = request.output_ids
    if reason.get("type") == "stop" and isinstance(reason.get("matched"), int) and not params.no_stop_trim:
        ids = ids[:-1]
    text = decode(ids, params.skip_special_tokens)
    matched = reason.get("matched")
    if (
        reason.get("type") == "stop"
        and isinstance(matched, str)
        and not params.no_stop_trim
        and matched in text
    ):
        text = text[: text.index(matched)]
    return text


def build_response(
    request: GenRequest,
    *,
    current_version: str,
    decode: Callable[[list[int], bool], str] | None,
    final: bool = True,
    return_prompt_token_ids: bool = False,
    capture: ChoiceCapture | None = None,
) -> dict:
    """The §4.2 response object of one sequence (a streaming chunk when `final` is False); `capture` adds
    the routed experts / indexer top-k the request asked for to the final answer."""
    spans = [{"version": v, "start": s, "end": e} for v, s, e in request.weight_spans]
    version = spans[-1]["version"] if spans else current_version
    reason = request.finish_reason if final else None
    meta: dict[str, Any] = {"id": request.rid, "finish_reason": reason}
    queued_abort = (
        final
        and reason is not None
        and reason.get("type") == "abort"
        and not request.output_ids
        and (reason.get("message") == "Abort in waiting queue")
    )
    if not queued_abort:
        meta.update(
            prompt_tokens=len(request.input_ids),
            completion_tokens=len(request.output_ids),
            cached_tokens=0,
            reasoning_tokens=0,
            num_retractions=request.num_retractions,
        )
    else:
        meta["completion_tokens"] = 0
    meta["weight_version"] = version
    if final:
        meta["weight_versions"] = spans
    if request.return_logprob and not queued_abort:
        meta["output_token_logprobs"] = [
            [lp, tok, None] for lp, tok in zip(request.output_logprobs, request.output_ids, strict=False)
        ]
        meta["output_token_logprobs_length"] = len(meta["output_token_logprobs"])
        start = request.logprob_start_len
        meta["input_token_logprobs"] = (
            [
                [lp, tok, None]
                for lp, tok in zip(request.input_logprobs or [], request.input_ids[start:], strict=False)
            ]
            if start >= 0
            else []
        )
    end = request.finished_at if (final and request.finished_at) else time.monotonic()
    if final and capture is not None and not queued_abort:
        meta.update(capture.meta_fields(request))
    meta["e2e_latency"] = round(end - request.created, 6)
    meta["response_sent_to_client_ts"] = time.time()
    out: dict[str, Any] = {}
    if decode is not None:
        out["text"] = (
            _output_text(request, decode)
            if final
            else decode(list(request.output_ids), request.params.skip_special_tokens)
        )
    out["output_ids"] = list(request.output_ids)
    out["meta_info"] = meta
    if return_prompt_token_ids:
        out["prompt_token_ids"] = list(request.input_ids)
    return out
