"""/release_memory_occupation and /resume_memory_occupation on the reference engine: SGLang 0.5.23's bodies
and answers (JSON null; tags null = all), and its refusals made strict (release while busy, without
--enable-memory-saver, twice; resume of what is not released; /generate while anything is released or
before resumed weights were rewritten). Released weights are really gone and come back only by an update."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import RecordingReceiver, in_thread, tensor_update, wait_until

GREEDY = {
    "input_ids": [5, 6, 7],
    "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
}
ALL = ["kv_cache", "weights", "cuda_graph"]


@pytest.fixture
def mclient(make_client):
    return make_client(enable_memory_saver=True)


def occupation(client) -> dict:
    return client.get("/server_info").json()["internal_states"][0]["memory_occupation"]


def push_weights(client, tensors: dict) -> None:
    entry, buffer = tensor_update(tensors)
    client.post("/begin_weight_update", json={})
    response = client.post("/update_weights_from_tensor", json={"serialized_named_tensors": [entry]})
    assert response.status_code == 200, response.text
    client.post("/end_weight_update", json={})
    del buffer


def test_release_then_resume_then_update_gives_the_same_answers(mclient):
    before = mclient.post("/generate", json=GREEDY).json()["output_ids"]
    weights = {n: t.clone() for n, t in mclient.app.state.engine.weights.state().items()}
    held = occupation(mclient)
    assert held["released"] == [] and held["weight_bytes"] > 2_000_000 and held["memory_saver"] is True

    release = mclient.post("/release_memory_occupation", json={})
    assert release.status_code == 200 and release.json() is None
    assert occupation(mclient)["released"] == sorted(ALL) and occupation(mclient)["weight_bytes"] == 0
    refused = mclient.post("/generate", json=GREEDY)
    assert refused.status_code == 400 and "memory is released" in refused.json()["error"]["message"]
    assert mclient.get("/health_generate").status_code == 503
    twice = mclient.post("/release_memory_occupation", json={"tags": ["weights"]})
    assert twice.status_code == 400 and "already released" in twice.json()["error"]["message"]

    assert mclient.get("/resume_memory_occupation").status_code == 200  # GET, no body: every tag
    # Again, tag by tag in slime's order: weights, then the update, then the KV cache and CUDA graphs.
    assert mclient.post("/release_memory_occupation", json={"tags": None}).status_code == 200
    assert mclient.post("/resume_memory_occupation", json={"tags": ["weights"]}).json() is None
    stale = mclient.post("/generate", json=GREEDY)
    assert stale.status_code == 400 and "memory is released (cuda_graph, kv_cache)" in stale.text
    push_weights(mclient, weights)  # resumed weights hold nothing until rewritten: the update does it
    assert mclient.post("/resume_memory_occupation", json={"tags": ["kv_cache", "cuda_graph"]}).json() is None
    assert occupation(mclient) == {**held, "stale_weight_tensors": 0}
    assert mclient.post("/generate", json=GREEDY).json()["output_ids"] == before
    assert mclient.get("/health_generate").status_code == 200


def test_resumed_weights_refuse_generation_until_rewritten(mclient):
    mclient.post("/release_memory_occupation", json={"tags": ["weights"]})
    mclient.post("/resume_memory_occupation", json={"tags": ["weights"]})
    assert occupation(mclient)["stale_weight_tensors"] > 100
    refused = mclient.post("/generate", json=GREEDY)
    assert refused.status_code == 400 and "hold no values since /resume_memory_occupation" in refused.text


def test_refusals(make_client, mclient):
    plain = make_client()
    no_saver = plain.post("/release_memory_occupation", json={})
    assert no_saver.status_code == 400 and "--enable-memory-saver" in no_saver.json()["error"]["message"]
    assert plain.post("/generate", json=GREEDY).status_code == 200
    unknown = mclient.post("/release_memory_occupation", json={"tags": ["weights", "activations"]})
    assert unknown.status_code == 400 and "unknown memory tags ['activations']" in unknown.text
    not_released = mclient.post("/resume_memory_occupation", json={"tags": ["kv_cache"]})
    assert not_released.status_code == 400 and "not released" in not_released.text
    bad = mclient.post("/release_memory_occupation", json={"tags": "weights"})
    assert bad.status_code == 400 and bad.json()["type"] == "Bad Request"
    assert occupation(mclient)["released"] == []


def test_release_refused_while_a_request_runs(mclient):
    generator = mclient.app.state.engine.generator
    long = {
        "input_ids": [5],
        "sampling_params": {"max_new_tokens": 1000, "temperature": 0, "ignore_eos": True},
    }
    thread, box = in_thread(lambda: mclient.post("/generate", json=long))
    wait_until(lambda: generator.num_requests()["running"] == 1)
    busy = mclient.post("/release_memory_occupation", json={})
    assert busy.status_code == 400
    assert "should be called only when server is idle. It has 1 running" in busy.json()["error"]["message"]
    mclient.post("/pause_generation", json={"mode": "in_place"})  # the batch and its KV stay: still busy
    assert mclient.post("/release_memory_occupation", json={}).status_code == 400
    mclient.post("/abort_request", json={"abort_all": True})
    thread.join(10)
    assert box["value"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert mclient.post("/release_memory_occupation", json={}).status_code == 200  # paused and idle
    assert occupation(mclient)["released"] == sorted(ALL)


def test_weight_routes_refuse_released_weights(make_client):
    fake = RecordingReceiver()
    client = make_client(enable_memory_saver=True, receiver=fake)
    client.post("/release_memory_occupation", json={"tags": ["weights"]})
    client.post("/begin_weight_update", json={})
    update = {"names": ["embed.weight"], "dtypes": ["float32"], "shapes": [[27, 64]]}
    distributed = client.post("/update_weights_from_distributed", json=update)
    assert distributed.status_code == 400 and "weights are released" in distributed.json()["message"]
    assert fake.calls == []  # refused before any broadcast is joined
    entry, _buffer = tensor_update({"embed.weight": torch.zeros(27, 64)})
    tensor = client.post("/update_weights_from_tensor", json={"serialized_named_tensors": [entry]})
    assert tensor.status_code == 400 and "weights are released" in tensor.json()["message"]
    checker = client.post("/weights_checker", json={"action": "checksum"})
    assert checker.status_code == 400 and "weights are released" in checker.json()["message"]
