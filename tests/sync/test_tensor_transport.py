"""The colocated sync's transport with the engines' HTTP mocked: every bucket goes to
/update_weights_from_tensor as handles the other side can open while the request is open, one entry per TP
rank, the version and the flush on the last bucket; a refusal is reported and breaks nothing."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch

from dsv4rl.config.choices import MemoryTag, SyncTransport
from dsv4rl.config.schema import SyncConfig
from dsv4rl.engine_client.client import EngineClient
from dsv4rl.engine_client.colocated import KV_AND_GRAPHS, ColocatedEngines
from dsv4rl.sync.weight_sync import WeightSync, WeightSyncError
from dsv4rl.wire.tensor_payload import deserialize, named_tensors


def weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    out = {f"block.{i}.weight": torch.randn(64, 32, generator=generator) for i in range(6)}
    out["block.0.table"] = torch.randint(0, 9, (7, 3), generator=generator)
    out["block.0.fp8"] = torch.randn(16, 16, generator=generator).to(torch.float8_e4m3fn)
    return out


class FakeEngine:
    """Answers like the engine and opens every handle while the request is open, as the engine must."""

    def __init__(self, name: str, refuse: set[int] | None = None) -> None:
        self.name, self.refuse = name, refuse or set()
        self.requests: list[tuple[str, dict]] = []
        self.loaded: dict[str, torch.Tensor] = {}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        self.requests.append((request.url.path, body))
        if request.url.path == "/update_weights_from_tensor":
            if len(self.requests) in self.refuse:
                return httpx.Response(400, json={"success": False, "message": "no room"})
            entries = body["serialized_named_tensors"]
            for entry in entries:  # every TP rank's entry opens on its own
                for name, tensor in named_tensors(deserialize(entry), body.get("load_format")):
                    self.loaded[name] = tensor.clone()
        return httpx.Response(200, json={"success": True, "message": "Success"})

    def client(self) -> EngineClient:
        return EngineClient(f"http://{self.name}", transport=httpx.MockTransport(self), retries=0)

    def tensor_requests(self) -> list[dict]:
        return [body for path, body in self.requests if path == "/update_weights_from_tensor"]


def make_sync(engines: list[FakeEngine], ranks: list[int], **kwargs) -> WeightSync:
    return WeightSync(
        [e.client() for e in engines], SyncConfig(bucket_bytes=4096, timeout_s=30), "gloo", "127.0.0.1", 1,
        engine_ranks=ranks, pause=False, transport=SyncTransport.tensor, **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize("load_format", ["per_tensor", "flattened_bucket"])
def test_every_bucket_reaches_every_engine_by_handle(load_format) -> None:
    engines = [FakeEngine("e0"), FakeEngine("e1")]
    sync = make_sync(engines, [1, 2], load_format=load_format)
    strategy = torch.multiprocessing.get_sharing_strategy()
    sent = weights()
    with sync:
        stats = sync.push(sent.items(), "v7", record_checksums=True)
    assert torch.multiprocessing.get_sharing_strategy() == strategy  # switched for the dumps only
    assert stats.transport == SyncTransport.tensor and stats.buckets >= 4
    assert stats.bytes == sum(t.numel() * t.element_size() for t in sent.values())
    for engine, ranks in zip(engines, [1, 2], strict=True):
        paths = [path for path, _ in engine.requests]
        assert paths == ["/begin_weight_update", *["/update_weights_from_tensor"] * stats.buckets,
                         "/end_weight_update"]  # fmt: skip
        assert engine.loaded.keys() == sent.keys()
        for name, tensor in sent.items():
            assert engine.loaded[name].dtype == tensor.dtype
            assert torch.equal(engine.loaded[name].view(torch.uint8), tensor.view(torch.uint8)), name
        bodies = engine.tensor_requests()
        assert all(len(b["serialized_named_tensors"]) == ranks for b in bodies)
        wire = None if load_format == "per_tensor" else load_format  # SGLang's null: per tensor
        assert all(b.get("load_format") == wire for b in bodies)
        assert [b.get("weight_version") for b in bodies] == [None] * (stats.buckets - 1) + ["v7"]
        assert [b["flush_cache"] for b in bodies] == [False] * (stats.buckets - 1) + [True]


def test_a_refused_bucket_is_reported_and_the_next_push_works() -> None:
    engines = [FakeEngine("e0"), FakeEngine("e1", refuse={3})]
    with make_sync(engines, [1, 1]) as sync:
        with pytest.raises(WeightSyncError, match=r"engine http://e1 /update_weights_from_tensor.*no room"):
            sync.push(weights().items(), "v1")
        assert sync.transport.broken is None  # no group: nothing to rebuild
        sync.push(weights().items(), "v2")
    assert engines[1].tensor_requests()[-1]["weight_version"] == "v2"


def test_colocated_engines_release_and_resume_what_they_released() -> None:
    engine = FakeEngine("e0")
    loop = asyncio.new_event_loop()
    try:
        colocated = ColocatedEngines([engine.client()], loop)
        colocated.resume([MemoryTag.weights])  # nothing released yet (the first sync): no call
        colocated.release()
        colocated.resume([MemoryTag.weights])
        colocated.resume(KV_AND_GRAPHS)
        colocated.resume(KV_AND_GRAPHS)
    finally:
        loop.close()
    assert engine.requests == [
        ("/release_memory_occupation", {"tags": None}),
        ("/resume_memory_occupation", {"tags": ["weights"]}),
        ("/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}),
    ]
