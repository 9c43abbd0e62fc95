"""Request bodies as SGLang 0.5.23's HTTP layer takes them, and the answers its encoders write.

`check` finds each request's route in SGLang's own FastAPI app (`sglang.srt.entrypoints.http_server.app`),
validates the JSON body with that route's own body field (the io_struct class FastAPI decodes it into,
unknown keys dropped as SGLang configures it), runs `/generate`'s contract gate (`generate_contract_error`,
the v1 schema that refuses unknown keys), `normalize_batch_and_arguments` and, per item, `SamplingParams`
with `verify` (what the tokenizer manager does next), and returns the decoded object as plain data.

`encode_choices` writes routed-expert / indexer choices the way SGLang answers them (the detokenizer's
`_b64_encode_per_request`, int32 bytes in base64) and decodes them with SGLang's own readers.

`rebuild_flattened` opens a flattened bucket with SGLang's `FlattenedTensorBucket`.
"""

from __future__ import annotations

from typing import Any


def _routes() -> dict[tuple[str, str], Any]:
    from fastapi.routing import APIRoute
    from sglang.srt.entrypoints import http_server

    return {
        (method, route.path): route
        for route in http_server.app.routes
        if isinstance(route, APIRoute)
        for method in route.methods
    }


def _generate_checks(obj, body: dict) -> None:
    from sglang.srt.entrypoints.api_contract import generate_contract_error
    from sglang.srt.sampling.sampling_params import SamplingParams

    error = generate_contract_error(body)
    if error is not None:
        raise ValueError(f"/generate contract: {error}")
    obj.normalize_batch_and_arguments()
    items = obj.sampling_params if isinstance(obj.sampling_params, list) else [obj.sampling_params]
    for params in items:
        SamplingParams(**dict(params)).verify(vocab_size=1 << 16)


def _builtins(value: Any) -> dict:
    import copy
    import dataclasses

    from sglang.srt.utils.msgspec_utils import msgspec_to_builtins

    if dataclasses.is_dataclass(value):  # GenerateReqInput is a dataclass, the control bodies msgspec structs
        return {f.name: copy.deepcopy(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return msgspec_to_builtins(value)


def check(requests: list[dict]) -> list[dict]:
    """Each {method, path, query, body}: {"decoded": the body as SGLang holds it, "error": str | None}."""
    import copy

    routes = _routes()
    out = []
    for request in requests:
        key = (request["method"], request["path"])
        route = routes.get(key)
        if route is None:
            out.append({"decoded": None, "error": f"SGLang has no route {key[0]} {key[1]}"})
            continue
        unknown = sorted(set(request.get("query") or {}) - {q.name for q in route.dependant.query_params})
        if unknown:
            out.append({"decoded": None, "error": f"query parameters SGLang does not read: {unknown}"})
            continue
        body = request.get("body")
        if route.body_field is None:
            error = None if not body else f"{key[1]} takes no body, got {sorted(body)}"
            out.append({"decoded": None, "error": error})
            continue
        value, errors = route.body_field.validate(copy.deepcopy(body), {}, loc=("body",))
        if errors:
            out.append({"decoded": None, "error": str(errors)})
            continue
        decoded = _builtins(value)  # as decoded, before the checks below normalize it in place
        try:
            if key[1] == "/generate":
                _generate_checks(value, body)
        except Exception as error:  # noqa: BLE001 - SGLang's refusal is the answer
            out.append({"decoded": None, "error": f"{type(error).__name__}: {error}"})
            continue
        out.append({"decoded": {k: v for k, v in decoded.items() if k in body}, "error": None})
    return out


def encode_choices(arrays: list[list]) -> list[dict]:
    """SGLang's wire form of per-request int32 choice arrays, and SGLang's own decoding of it."""
    import numpy as np
    import torch
    from sglang.srt.managers.detokenizer_manager import DetokenizerManager
    from sglang.srt.state_capturer.indexer_topk import extract_indexer_topk_from_meta_info
    from sglang.srt.state_capturer.routed_experts import extract_routed_experts_from_meta_info

    tensors = [torch.tensor(np.asarray(a, dtype=np.int32)) for a in arrays]
    encoded = DetokenizerManager._b64_encode_per_request(tensors)
    out = []
    for text in encoded:
        meta = {"meta_info": {"routed_experts": text, "indexer_topk": text}}
        out.append({
            "base64": text,
            "routed_experts": extract_routed_experts_from_meta_info(meta).tolist(),
            "indexer_topk": extract_indexer_topk_from_meta_info(meta).tolist(),
        })  # fmt: skip
    return out


def rebuild_flattened(
    names: list[str], dtypes: list[str], shapes: list[list[int]], payload: str, out: str
) -> None:
    """`FlattenedTensorBucket` over the bytes in `payload`, its tensors written to `out` (safetensors)."""
    from pathlib import Path

    import torch
    from safetensors.torch import save_file
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    bucket = FlattenedTensorBucket.empty(names, dtypes, shapes, "cpu")
    data = Path(payload).read_bytes()
    bucket.get_flattened_tensor().copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    save_file({name: t.contiguous() for name, t in bucket.reconstruct_tensors()}, out)
