"""End to end, colocated: WeightSync with the tensor transport pushes a trainer model into real reference
engine processes (started with --enable-memory-saver) through /dev/shm handles, in the loop's order:
release everything, resume the weights, push, resume the KV cache. Afterwards each engine holds exactly
what the wire format makes of the trainer's weights (sha256 of the raw bytes, FP8/MXFP4 bytes and E8M0
scales included) and computes the trainer's log-probs; every request is one SGLang 0.5.23 takes."""

from __future__ import annotations

import asyncio
import json

import httpx
import torch
from sync_helpers import TRAINER_SEED, quantized_copy, trainer_model, wire_tensors

from dsv4rl.config.choices import MemoryTag, QuantMode, RolloutEngineKind, SyncTransport
from dsv4rl.config.schema import QuantConfig, SyncConfig
from dsv4rl.engine.sglang_contract import load_contract, request_problems
from dsv4rl.engine_client.client import EngineClient
from dsv4rl.engine_client.colocated import KV_AND_GRAPHS, ColocatedEngines
from dsv4rl.sync.served_format import check_served_formats
from dsv4rl.sync.weight_sync import WeightSync
from dsv4rl.wire.checksum import checksums

TOKENS = [0, 5, 9, 13, 4, 16, 7, 7, 15, 3, 11, 19, 6, 18, 2, 9, 1, 14, 8, 17, 10, 12, 5, 17]


class Recorder(httpx.AsyncBaseTransport):
    """Forwards to the real engine and records (method, path, JSON body) of every request."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict | None]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.requests.append((request.method, request.url.path, body))
        async with httpx.AsyncHTTPTransport() as transport:  # one per call: requests come from two loops
            response = await transport.handle_async_request(request)
            content = await response.aread()
        return httpx.Response(response.status_code, headers=response.headers, content=content)


def held_checksums(url: str) -> dict[str, str]:
    body = httpx.post(f"{url}/weights_checker", json={"action": "checksum"}, timeout=30).json()
    return body["ranks"][0]["checksums"]


def engine_logprobs(url: str) -> torch.Tensor:
    body = {"input_ids": TOKENS, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
            "logprob_start_len": 0}  # fmt: skip
    out = httpx.post(f"{url}/generate", json=body, timeout=60).json()
    return torch.tensor([lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]])


@torch.no_grad()
def trainer_logprobs(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.tensor([TOKENS])
    logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
    return logprobs.gather(1, ids[0, 1:, None]).squeeze(1)


def colocated_step(url: str, model: torch.nn.Module, version: str, transport=None, **kwargs):
    """The loop's colocated order against one engine; returns the sync's stats."""
    client = EngineClient(url, timeout_s=60, transport=transport)
    loop = asyncio.new_event_loop()
    colocated = ColocatedEngines([client], loop)
    sync = WeightSync(
        [client], SyncConfig(bucket_bytes=32 * 1024, timeout_s=60), "gloo", "127.0.0.1", 1,
        pause=False, transport=SyncTransport.tensor, **kwargs,
    )  # fmt: skip
    try:
        sync.connect()
        colocated.release()
        refused = httpx.post(f"{url}/generate", json={"input_ids": TOKENS[:3]}, timeout=30)
        assert refused.status_code == 400 and "memory is released" in refused.text
        colocated.resume([MemoryTag.weights])
        stats = sync.push(model.state_dict().items(), version, record_checksums=True)
        colocated.resume(KV_AND_GRAPHS)
    finally:
        sync.close()
        loop.run_until_complete(client.aclose())
        loop.close()
    return stats


def test_colocated_sync_leaves_the_trainers_weights_bit_for_bit(colocated_engines) -> None:
    url = colocated_engines[QuantMode.none]
    model = trainer_model(TRAINER_SEED)
    ours = checksums(wire_tensors(model))
    before = held_checksums(url)
    assert all(before[name] != ours[name] for name in ours), "every tensor must change"
    recorder = Recorder()
    stats = colocated_step(url, model, "c1", transport=recorder)
    assert stats.transport == SyncTransport.tensor and stats.buckets > 20 and stats.checksums == ours
    assert held_checksums(url) == ours  # every tensor, bit for bit
    assert (engine_logprobs(url) - trainer_logprobs(model)).abs().max().item() < 1e-4
    assert httpx.get(f"{url}/model_info", timeout=10).json()["weight_version"] == "c1"
    info = httpx.get(f"{url}/server_info", timeout=10).json()["internal_states"][0]["memory_occupation"]
    assert info["released"] == [] and info["stale_weight_tensors"] == 0 and info["weight_bytes"] > 0
    paths = [path for _, path, _ in recorder.requests]
    assert paths[:2] == ["/release_memory_occupation", "/resume_memory_occupation"]
    assert paths[-2:] == ["/end_weight_update", "/resume_memory_occupation"]
    contract = load_contract()
    assert [p for m, path, body in recorder.requests for p in request_problems(contract, m, path, body)] == []


def test_flattened_buckets_into_an_fp8_mxfp4_engine(colocated_engines, tmp_path) -> None:
    """FP8 weights, int8-packed MXFP4 experts and E8M0 scales cross the shared memory as bytes."""
    url = colocated_engines[QuantMode.fp8_mxfp4]
    model = trainer_model(TRAINER_SEED + 1)
    loop = asyncio.new_event_loop()
    try:
        wire = check_served_formats(
            [EngineClient(url)], QuantConfig(name=QuantMode.fp8_mxfp4), RolloutEngineKind.reference, {},
            "/nonexistent", loop,
        )  # fmt: skip
    finally:
        loop.close()
    stats = colocated_step(url, model, "c2", wire_format=wire, load_format="flattened_bucket")
    expected = checksums(wire_tensors(model, "fp8_mxfp4"))
    assert stats.checksums == expected and any(n.endswith(".scale") for n in expected)
    assert held_checksums(url) == expected
    reference = quantized_copy(model, "fp8_mxfp4", tmp_path / "expected")
    assert (engine_logprobs(url) - trainer_logprobs(reference)).abs().max().item() < 1e-4
