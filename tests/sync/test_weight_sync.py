"""End to end: WeightSync pushes a trainer model into real reference engines over gloo.

The engines (`python -m dsv4rl.engine`, their /update_weights_from_distributed calling the real
WeightReceiver) start from seed ENGINE_SEED; the trainer holds a different model. After a push an engine
holds exactly what the wire format makes of the trainer's weights (sha256 of the raw bytes, native names,
incl. the int64 tid2eid tables, FP8 bytes and scales), and it computes the log-probs of those weights.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
import torch
from sync_helpers import TRAINER_SEED, quantized_copy, trainer_model, wire_tensors

from dsv4rl.config.choices import QuantMode, RolloutEngineKind
from dsv4rl.config.schema import QuantConfig, SyncConfig
from dsv4rl.engine.sglang_contract import load_contract, request_problems
from dsv4rl.engine_client.client import EngineClient
from dsv4rl.model.tokenizer import build_char_tokenizer
from dsv4rl.sync.served_format import check_served_formats
from dsv4rl.sync.weight_sync import SyncStats, WeightSync, WeightSyncError
from dsv4rl.wire.checksum import checksums
from free_ports import free_port

TOKENS = [0, 5, 9, 13, 4, 16, 7, 7, 15, 3, 11, 19, 6, 18, 2, 9, 1, 14, 8, 17, 10, 12, 5, 17]


def engine_checksums(url: str) -> dict[str, str]:
    body = httpx.post(f"{url}/weights_checker", json={"action": "checksum"}, timeout=30).json()
    return body["ranks"][0]["checksums"]


def engine_logprobs(url: str) -> torch.Tensor:
    async def go() -> dict:
        client = EngineClient(url, timeout_s=60)
        try:
            return await client.generate(TOKENS, {"max_new_tokens": 0}, True, 0)
        finally:
            await client.aclose()

    out = asyncio.run(go())
    return torch.tensor([lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]])


@torch.no_grad()
def trainer_logprobs(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.tensor([TOKENS])
    logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
    return logprobs.gather(1, ids[0, 1:, None]).squeeze(1)


class RecordingTransport(httpx.AsyncBaseTransport):
    """Forwards to the real engine and records (method, path, JSON body, query) of every request."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict | None, dict]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.requests.append((request.method, request.url.path, body, dict(request.url.params)))
        async with httpx.AsyncHTTPTransport() as transport:  # one per call: requests come from two loops
            response = await transport.handle_async_request(request)
            content = await response.aread()
        return httpx.Response(response.status_code, headers=response.headers, content=content)


def make_sync(url: str | list[str], bucket_bytes: int, transport=None, **kwargs) -> WeightSync:
    """Per tensor (SGLang's default) unless the test says otherwise; recipes default to flattened buckets."""
    kwargs.setdefault("load_format", "per_tensor")
    cfg = SyncConfig(
        bucket_bytes=bucket_bytes, timeout_s=kwargs.pop("timeout_s", 60.0), **kwargs.pop("cfg", {})
    )
    urls = [url] if isinstance(url, str) else url
    clients = [EngineClient(u, timeout_s=60, transport=transport) for u in urls]
    return WeightSync(clients, cfg, "gloo", "127.0.0.1", free_port(), **kwargs)


def assert_engine_holds(url: str, model: torch.nn.Module, quant: str = "none", tmp_path=None) -> None:
    expected = checksums(wire_tensors(model, quant))
    got = engine_checksums(url)
    assert got.keys() == expected.keys()
    differing = sorted(name for name in expected if got[name] != expected[name])
    assert not differing, f"{len(differing)} tensors differ after the sync: {differing[:8]}"
    reference = model if quant == "none" else quantized_copy(model, quant, tmp_path / f"expected-{quant}")
    assert (engine_logprobs(url) - trainer_logprobs(reference)).abs().max().item() < 1e-4


def version_of(url: str) -> str:
    return httpx.get(f"{url}/model_info", timeout=10).json()["weight_version"]


def test_push_many_buckets_native_names(engine_url: str) -> None:
    model = trainer_model(TRAINER_SEED)
    before = engine_checksums(engine_url)
    ours = checksums(wire_tensors(model))
    assert all(before[name] != ours[name] for name in ours), (
        "every tensor must change, or the test proves little"
    )
    assert any("tid2eid" in n for n in ours) and any(n.endswith("ffn.gate.bias") for n in ours)

    sync = make_sync(engine_url, bucket_bytes=32 * 1024)
    try:
        sync.connect()
        stats = sync.push(model.state_dict().items(), "v1", record_checksums=True)
    finally:
        sync.close()
    assert isinstance(stats, SyncStats)
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert stats.bytes == total and stats.buckets > 20 and stats.tensors > 89 and stats.gb_per_s > 0
    assert stats.checksums == ours
    assert stats.transfer_seconds > 0 and stats.control_seconds > 0
    assert version_of(engine_url) == "v1"
    assert_engine_holds(engine_url, model)


def test_push_flattened_buckets_to_two_engines(engine_urls: list[str]) -> None:
    """Two engines: ranks 1 and 2 of a world of 3; one flattened broadcast per bucket reaches both. Every
    request of the sync is one SGLang 0.5.23 takes as meant (its released contract)."""
    model = trainer_model(TRAINER_SEED + 1)
    recorder = RecordingTransport()
    with make_sync(
        engine_urls, bucket_bytes=64 * 1024, transport=recorder, load_format="flattened_bucket"
    ) as sync:
        assert sync.world_size == 3
        stats = sync.push(model.state_dict().items(), "v2-flat")
    assert stats.buckets > 5
    contract = load_contract()
    paths = {path for _, path, _, _ in recorder.requests}
    assert {"/init_weights_update_group", "/begin_weight_update", "/update_weights_from_distributed"} <= paths
    problems = [p for request in recorder.requests for p in request_problems(contract, *request)]
    assert problems == []
    for url in engine_urls:
        assert version_of(url) == "v2-flat"
        assert_engine_holds(url, model)


def sync_requests(recorder: RecordingTransport) -> list[str]:
    """The request paths of the pushes (after the group was joined)."""
    paths = [path for _, path, _, _ in recorder.requests]
    return paths[paths.index("/init_weights_update_group") + 1 :]


def test_push_in_one_bucket_costs_three_requests(engine_url: str) -> None:
    """A small model goes as one bucket; without a pause (the synchronous loop) a sync is: open the
    session, the bucket (which sets the version and flushes the cache), close the session."""
    model = trainer_model(TRAINER_SEED + 2)
    recorder = RecordingTransport()
    with make_sync(engine_url, bucket_bytes=1 << 30, transport=recorder, pause=False) as sync:
        stats = sync.push(model.state_dict().items(), "v3-one")
    assert stats.buckets == 1 and stats.tensors == len(wire_tensors(model))
    assert sync_requests(recorder)[:3] == [
        "/begin_weight_update",
        "/update_weights_from_distributed",
        "/end_weight_update",
    ]
    bucket = next(
        body for _, path, body, _ in recorder.requests if path == "/update_weights_from_distributed"
    )
    assert bucket["weight_version"] == "v3-one" and bucket["flush_cache"] is True
    assert version_of(engine_url) == "v3-one"
    assert_engine_holds(engine_url, model)


def test_paused_push_sends_version_and_flush_on_the_last_bucket_only(engine_url: str) -> None:
    model = trainer_model(TRAINER_SEED + 5)
    recorder = RecordingTransport()
    with make_sync(engine_url, bucket_bytes=64 * 1024, transport=recorder) as sync:
        stats = sync.push(model.state_dict().items(), "v5-paused")
    paths = sync_requests(recorder)[: stats.buckets + 4]
    assert paths == [
        "/pause_generation",
        "/begin_weight_update",
        *["/update_weights_from_distributed"] * stats.buckets,
        "/end_weight_update",
        "/continue_generation",
    ]
    buckets = [body for _, path, body, _ in recorder.requests if path == "/update_weights_from_distributed"]
    assert [(b.get("weight_version"), b["flush_cache"]) for b in buckets] == [(None, False)] * (
        stats.buckets - 1
    ) + [("v5-paused", True)]
    assert version_of(engine_url) == "v5-paused"


class GatedOpening(RecordingTransport):
    """Holds /begin_weight_update until the trainer starts pulling tensors from its pipeline (5 s at most),
    and records whether that happened while the request was held."""

    def __init__(self) -> None:
        super().__init__()
        self.gather_started = threading.Event()
        self.overlapped: bool | None = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/begin_weight_update":
            self.overlapped = await asyncio.to_thread(self.gather_started.wait, 5.0)
        return await super().handle_async_request(request)


def test_the_session_opens_while_the_first_bucket_is_packed(engine_url: str) -> None:
    """push sends /begin_weight_update and packs the first bucket meanwhile; the bucket still goes only
    once the session is open (the engine would refuse it otherwise)."""
    model = trainer_model(TRAINER_SEED + 6)
    recorder = GatedOpening()

    def weights():
        recorder.gather_started.set()
        yield from model.state_dict().items()

    with make_sync(engine_url, bucket_bytes=1 << 30, transport=recorder, pause=False) as sync:
        sync.push(weights(), "v6-overlap")
    assert recorder.overlapped is True
    assert sync_requests(recorder)[:3] == [
        "/begin_weight_update",
        "/update_weights_from_distributed",
        "/end_weight_update",
    ]
    assert version_of(engine_url) == "v6-overlap"
    assert_engine_holds(engine_url, model)


def test_a_pipeline_failure_closes_the_session_it_opened(engine_url: str) -> None:
    """The pipeline fails before any bucket: the session opened alongside is closed again, so the next
    push can open one (a second begin_weight_update on an open session is refused)."""
    model = trainer_model(TRAINER_SEED + 7)

    def broken():
        raise RuntimeError("gather failed")
        yield  # a generator

    with make_sync(engine_url, bucket_bytes=1 << 30, pause=False) as sync:
        with pytest.raises(RuntimeError, match="gather failed"):
            sync.push(broken(), "never")
        sync.push(model.state_dict().items(), "v7-after")
    assert version_of(engine_url) == "v7-after"
    assert_engine_holds(engine_url, model)


def test_a_refused_opening_stops_the_push_before_any_bucket(engine_url: str) -> None:
    """An engine that already has a session open refuses begin_weight_update: the push fails naming
    it, sends no bucket, and does not close the session someone else opened."""
    model = trainer_model(TRAINER_SEED + 8)
    recorder = RecordingTransport()
    assert httpx.post(f"{engine_url}/begin_weight_update", json={}, timeout=10).status_code == 200
    try:
        refused = pytest.raises(WeightSyncError, match=r"(?s)opening the weight-update session.*already open")
        with make_sync(engine_url, bucket_bytes=1 << 30, transport=recorder, pause=False) as sync, refused:
            sync.push(model.state_dict().items(), "never")
        assert sync_requests(recorder)[:2] == ["/begin_weight_update", "/destroy_weights_update_group"]
    finally:
        assert httpx.post(f"{engine_url}/end_weight_update", json={}, timeout=10).status_code == 200


def test_refused_bucket_fails_fast_then_reconnect_works(engine_url: str) -> None:
    """A bucket the engine refuses (HTTP 400, nothing received) must not hang the trainer's broadcast."""
    model = trainer_model(TRAINER_SEED + 3)
    items = list(model.state_dict().items())
    bad = [*items[:10], ("model.norm.weight", torch.zeros(65)), *items[10:]]
    sync = make_sync(engine_url, bucket_bytes=8 * 1024, timeout_s=60.0)
    try:
        sync.connect()
        start = time.monotonic()
        with pytest.raises(WeightSyncError, match=r"(?s)engine http://127\.0\.0\.1:\d+.*float32 \[65\]"):
            sync.push(bad, "never")
        assert time.monotonic() - start < 15, "a refused bucket must fail long before the group timeout"
        with pytest.raises(WeightSyncError, match="unusable"):
            sync.push(items, "never")
        start = time.monotonic()
        sync.close()
        assert time.monotonic() - start < 30
        sync.connect()
        sync.push(items, "v4")
    finally:
        sync.close()
    assert version_of(engine_url) == "v4"
    assert_engine_holds(engine_url, model)


@pytest.mark.parametrize("quant", [QuantMode.bf16, QuantMode.fp8_rollout, QuantMode.fp8_mxfp4])
def test_quantized_push_into_an_engine_serving_that_format(quantized_engines, quant, tmp_path) -> None:
    """The wire format comes from what the engine serves; the engine then holds exactly the quantized
    weights (bytes and scales) and computes with their dequantized values."""
    url = quantized_engines[quant]
    model = trainer_model(TRAINER_SEED + 4)
    loop = asyncio.new_event_loop()
    sync = make_sync(url, bucket_bytes=16 * 1024)
    try:
        sync.connect()
        sync.wire_format = check_served_formats(
            sync.clients, QuantConfig(name=quant), RolloutEngineKind.reference, {}, "/nonexistent", loop
        )
        stats = sync.push(model.state_dict().items(), f"v-{quant.value}", record_checksums=True)
    finally:
        sync.close()
        loop.close()
    assert stats.checksums == checksums(wire_tensors(model, quant.value))
    if quant != QuantMode.bf16:
        assert any(n.endswith(".scale") for n in stats.checksums)
    assert_engine_holds(url, model, quant.value, tmp_path)


def test_a_format_the_engine_does_not_hold_is_refused_before_any_byte(quantized_engines) -> None:
    url = quantized_engines[QuantMode.fp8_mxfp4]
    before = engine_checksums(url)
    loop = asyncio.new_event_loop()
    sync = make_sync(url, bucket_bytes=1 << 30)
    try:
        sync.connect()
        with pytest.raises(WeightSyncError, match=r"serves fp8_mxfp4 .* but the recipe sends quant=none"):
            check_served_formats(
                sync.clients, QuantConfig(), RolloutEngineKind.reference, {}, "/nonexistent", loop
            )
        # Pushing anyway (no wire format): refused on the first tensor, naming it and both formats.
        shape = rf"\[{len(build_char_tokenizer())}, 64\]"
        pattern = rf"embed\.weight: the engine holds bfloat16 {shape}.*fp8_mxfp4.*sends float32 {shape}"
        with pytest.raises(WeightSyncError, match=pattern):
            sync.push(trainer_model(TRAINER_SEED).state_dict().items(), "never")
    finally:
        sync.close()
        loop.close()
    assert engine_checksums(url) == before  # nothing written
    assert version_of(url) != "never"


def test_configuration_errors() -> None:
    def build(backend="gloo", **cfg):
        return WeightSync([EngineClient("http://127.0.0.1:1")], SyncConfig(**cfg), backend, "127.0.0.1", 1)

    # the recipe's sizes and timeouts are checked once, by validation (tests/checks); here only the choices
    for kwargs, message in [
        ({"backend": "mpi"}, "comm.backend='mpi' is unknown; choose one of gloo, nccl"),
        ({"pause_mode": "later"}, "sync.pause_mode"),
    ]:
        with pytest.raises(ValueError, match=message):
            build(**kwargs)
    with pytest.raises(ValueError, match="load_format"):
        WeightSync([EngineClient("http://x")], SyncConfig(), "gloo", "127.0.0.1", 1, load_format="direct")
    with pytest.raises(ValueError, match="engine_ranks"):
        WeightSync([EngineClient("http://x")], SyncConfig(), "gloo", "127.0.0.1", 1, engine_ranks=[0])
    with pytest.raises(WeightSyncError, match="connect"):
        build().push([("embed.weight", torch.zeros(1))], "v")
    assert SyncStats(bytes=2_000_000_000, seconds=2.0).gb_per_s == 1.0


def test_connect_failure_names_the_engine() -> None:
    """An engine that cannot join (here: nothing listens) fails connect() at once, naming the engine."""
    dead = f"http://127.0.0.1:{free_port()}"
    sync = make_sync(dead, bucket_bytes=1 << 20, timeout_s=20.0)
    start = time.monotonic()
    try:
        with pytest.raises(WeightSyncError, match=rf"engine {dead} could not join.*cannot connect"):
            sync.connect()
        assert time.monotonic() - start < 10
        assert not sync.connected
    finally:
        sync.close()


def test_regroup_moves_a_stale_client_to_the_address_rank_0_gives(engine_urls) -> None:
    """Another pipeline stage's sender holds clients of its own: an engine that rank 0 found restarted on
    another port is reached there once the group is rebuilt with rank 0's addresses."""
    model = trainer_model(TRAINER_SEED + 4)
    with make_sync(engine_urls, bucket_bytes=64 * 1024) as sync:
        sync.regroup([0])
        sync.all_clients[1].move_to(f"http://127.0.0.1:{free_port()}")  # where it listened before
        sync.regroup([0, 1], urls=engine_urls)
        assert [c.base_url for c in sync.clients] == engine_urls
        sync.push(model.state_dict().items(), "moved")
    assert [version_of(url) for url in engine_urls] == ["moved", "moved"]
    assert_engine_holds(engine_urls[1], model)


def test_regroup_goes_on_without_a_lost_engine_and_takes_it_back_with_a_full_push(engine_urls) -> None:
    """A lost engine leaves the group (rebuilt under a new name on the same port) and rejoins it later;
    the next push gives it every weight, and every request is one SGLang 0.5.23 takes."""
    first, second = trainer_model(TRAINER_SEED + 2), trainer_model(TRAINER_SEED + 3)
    recorder = RecordingTransport()
    with make_sync(engine_urls, bucket_bytes=64 * 1024, transport=recorder) as sync:
        sync.push(first.state_dict().items(), "r1")
        sync.regroup([0])
        assert (sync.group_name, sync.world_size) == ("weight_update_group-regroup1", 2)
        sync.push(second.state_dict().items(), "r2")
        assert [version_of(url) for url in engine_urls] == ["r2", "r1"]
        sync.regroup([0, 1])
        assert (sync.group_name, sync.world_size) == ("weight_update_group-regroup2", 3)
        sync.push(second.state_dict().items(), "r3")
    for url in engine_urls:
        assert version_of(url) == "r3"
        assert_engine_holds(url, second)
    contract = load_contract()
    assert [p for request in recorder.requests for p in request_problems(contract, *request)] == []
    destroyed = [body["group_name"] for _, path, body, _ in recorder.requests if path.endswith("group")
                 and path.startswith("/destroy")]  # fmt: skip
    assert destroyed == ["weight_update_group", "weight_update_group", "weight_update_group-regroup1",
                         "weight_update_group-regroup2", "weight_update_group-regroup2"]  # fmt: skip
