"""Every request dsv4rl's engine client sends, taken by SGLang 0.5.23's own HTTP layer in SGLang's
interpreter; the choices SGLang's own encoder writes, read back by dsv4rl's rollout; dsv4rl's flattened
buckets opened by SGLang's own `FlattenedTensorBucket`.

The bodies are captured from the real client code paths (`generate_samples` in both sampling modes with
the replays asked for, the weight sync's and the colocated mode's calls) on a recording transport. SGLang's
side validates each against its route's own body class (unknown keys dropped, as SGLang configures it),
so the test also asserts that every key dsv4rl sends survives that decoding with its value: a renamed
field would be dropped silently by the server."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dsv4rl.config.compose import compose
from dsv4rl.config.sglang_choices import PauseMode
from dsv4rl.data.problems import Problem
from dsv4rl.engine_client.client import EngineClient
from dsv4rl.model.tiny import load_model
from dsv4rl.model.tokenizer import load_tokenizer
from dsv4rl.model.wire_format import WireFormat
from dsv4rl.rollout.choices import ChoiceRequest
from dsv4rl.rollout.generate import generate_samples
from dsv4rl.sync.pipeline import wire_buckets
from dsv4rl.wire.layout import FLATTENED_BUCKET, bucket_metadata, flatten_bucket, sort_for_flattening
from dsv4rl.wire.tensor_payload import pack_bucket, serialize
from sglang_runner import needs_sglang

pytestmark = [*needs_sglang, pytest.mark.slow]

GROUP = 2
RESPONSE = [5, 6, 1]  # two tokens and EOS


class Recorder:
    """An engine that records each request and answers as SGLang would (choices from `choices`)."""

    def __init__(self, choices: list[str]) -> None:
        self.requests: list[dict] = []
        self.choices = iter(choices)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.requests.append({"method": request.method, "path": request.url.path,
                              "query": dict(request.url.params), "body": body})  # fmt: skip
        if request.url.path == "/generate":
            params = body["sampling_params"]
            n = (params[0] if isinstance(params, list) else params)["n"]  # one n per request (dsv4rl's)
            return httpx.Response(200, json=[self._output(body) for _ in range(len(body["input_ids"]) * n)])
        if request.url.path == "/flush_cache":
            return httpx.Response(200, text="Cache flushed.")
        return httpx.Response(200, json={"success": True, "message": "Success"})

    def _output(self, body: dict) -> dict:
        meta = {"finish_reason": {"type": "stop"}, "weight_version": "3",
                "output_token_logprobs": [[-0.5, t, None] for t in RESPONSE]}  # fmt: skip
        if body.get("return_routed_experts"):
            meta["routed_experts"] = next(self.choices)
        if body.get("return_indexer_topk"):
            meta["indexer_topk"] = next(self.choices)
        return {"text": "", "output_ids": RESPONSE, "meta_info": meta}


def _choices(prompt_len: int, samples: int, width: int) -> list[np.ndarray]:
    """One int32 array per answer field: rows = prompt + response - 1 positions, `width` ids per row."""
    generator = np.random.default_rng(0)
    rows = prompt_len + len(RESPONSE) - 1
    return [generator.integers(-1, 8, size=(rows, width), dtype=np.int32) for _ in range(2 * samples)]


def _captured(tmp_path: Path, encoded: list[str]) -> tuple[list[dict], list, list]:
    cfg = compose("tiny_arith")
    tokenizer = load_tokenizer(cfg.model)
    problems = [Problem(prompt="1+2=", answer="3", id="a"), Problem(prompt="2+2=", answer="4", id="b")]
    recorder = Recorder(encoded)
    client = EngineClient(
        "http://engine", api_key="k", admin_api_key="a", transport=httpx.MockTransport(recorder)
    )
    model = load_model(cfg.model, vocab_size=len(tokenizer))
    bucket = sort_for_flattening(
        next(iter(wire_buckets(model.state_dict().items(), WireFormat("fp8_rollout"), 1 << 30)))
    )
    meta = bucket_metadata(bucket)
    payload, keep = pack_bucket(bucket[:3], FLATTENED_BUCKET, torch.device("cpu"))

    async def drive() -> list:
        asks = ChoiceRequest(routed_experts=True, indexer_topk=True)
        samples = []
        for seed in (None, 1234):  # n samples per item / one seeded item per sample
            samples += await generate_samples([client], problems, tokenizer, GROUP, cfg.algo.sampling, seed,
                                              choices=asks)  # fmt: skip
        await client.pause_generation(PauseMode.retract)
        await client.flush_cache(timeout_s=5.0)
        await client.begin_weight_update()
        await client.init_weights_update_group("10.0.0.1", 29600, 1, 17, "weight_update_group-pp1", "nccl")
        await client.update_weights_from_distributed(
            meta["names"], meta["dtypes"], meta["shapes"], "weight_update_group-pp1", flush_cache=True,
            weight_version="3", load_format=FLATTENED_BUCKET,
        )  # fmt: skip
        await client.update_weights_from_distributed(
            meta["names"][:2], meta["dtypes"][:2], meta["shapes"][:2]
        )
        await client.update_weights_from_tensor([serialize(payload)], FLATTENED_BUCKET, True, "3")
        await client.end_weight_update()
        await client.update_weight_version("3")
        await client.destroy_weights_update_group("weight_update_group-pp1")
        # an engine was lost: the group is rebuilt under a new name with the engines that answer
        await client.init_weights_update_group(
            "10.0.0.1", 29600, 1, 9, "weight_update_group-pp1-regroup1", "nccl"
        )
        await client.continue_generation()
        await client.release_memory_occupation(["weights", "kv_cache"])
        await client.resume_memory_occupation(None)
        await client.abort_request("", abort_all=True)
        await client.weights_checker("snapshot")
        await client.aclose()
        return samples

    samples = asyncio.run(drive())
    del keep
    return recorder.requests, samples, bucket


def _plain(value):
    """Tuples as lists, recursively: JSON's view of a decoded value."""
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def test_sglang_takes_every_request_dsv4rl_sends(tmp_path: Path, sglang_sides) -> None:
    arrays = _choices(prompt_len=5, samples=2 * 2 * GROUP, width=6)
    side = sglang_sides.get()
    encoded = side.call("http_requests:encode_choices", arrays=[a.tolist() for a in arrays])
    requests, samples, _ = _captured(tmp_path, [e["base64"] for e in encoded])
    assert {r["path"] for r in requests} >= {
        "/generate", "/pause_generation", "/flush_cache", "/begin_weight_update",
        "/init_weights_update_group",
        "/update_weights_from_distributed", "/update_weights_from_tensor", "/end_weight_update",
        "/update_weight_version", "/destroy_weights_update_group", "/continue_generation",
        "/release_memory_occupation", "/resume_memory_occupation", "/abort_request", "/weights_checker",
    }  # fmt: skip
    checked = side.call("http_requests:check", requests=requests)
    for request, result in zip(requests, checked, strict=True):
        where = f"{request['method']} {request['path']}"
        assert result["error"] is None, f"{where}: SGLang refuses it: {result['error']}"
        body = request["body"] or {}
        dropped = sorted(set(body) - set(result["decoded"] or {}))
        assert not dropped, f"{where}: SGLang drops {dropped} (not fields of its request class)"
        for key, value in body.items():
            held = _plain(result["decoded"][key])
            if key == "serialized_named_tensors":  # SGLang's Base64Bytes fields hold the decoded bytes
                value = [base64.b64decode(v) for v in value]
            assert held == value, f"{where}: {key} reads as {str(held)[:200]}, sent {str(value)[:200]}"
    # SGLang's encoder wrote the choices; dsv4rl's rollout decoded the same rows SGLang's readers do
    for index, sample in enumerate(samples):
        routed, indexer = arrays[2 * index], arrays[2 * index + 1]
        assert np.array_equal(np.asarray(sample.routed_experts).reshape(routed.shape), routed)
        assert np.array_equal(np.asarray(sample.indexer_topk).reshape(indexer.shape), indexer)
        assert encoded[2 * index]["routed_experts"] == routed.reshape(-1).tolist()
        assert encoded[2 * index + 1]["indexer_topk"] == indexer.reshape(-1).tolist()


def test_sglang_rebuilds_the_flattened_bucket(tmp_path: Path, sglang_sides) -> None:
    cfg = compose("tiny_arith")
    model = load_model(cfg.model, vocab_size=len(load_tokenizer(cfg.model)))
    bucket = sort_for_flattening(
        next(iter(wire_buckets(model.state_dict().items(), WireFormat("fp8_rollout"), 1 << 30)))
    )
    meta = bucket_metadata(bucket)  # the request's body: what SGLang allocates its buffer from
    (tmp_path / "flat.bin").write_bytes(flatten_bucket(bucket, "cpu").numpy().tobytes())
    out = tmp_path / "out.safetensors"
    sglang_sides.get().call(
        "http_requests:rebuild_flattened", **meta, payload=str(tmp_path / "flat.bin"), out=str(out)
    )
    rebuilt = load_file(str(out))
    assert sorted(rebuilt) == sorted(meta["names"]) and len(rebuilt) > 100
    for name, tensor in bucket:
        held = rebuilt[name]
        assert held.dtype == tensor.dtype and held.shape == tensor.shape, name
        assert torch.equal(held.view(torch.uint8), tensor.contiguous().view(torch.uint8)), name
