"""Pause/continue, aborts, flush, health, auth, rids and weight-version spans."""

from __future__ import annotations

import gc
import time

import pytest
from engine_helpers import in_thread, wait_until

# Long enough never to finish by itself within a test (about 10 ms a step); every use aborts it.
LONG = {"max_new_tokens": 1000, "temperature": 0, "ignore_eos": True}


def running(client) -> bool:
    return client.app.state.engine.generator.num_requests()["running"] > 0


def start_long(client, rid: str = "long", **params):
    thread, box = in_thread(
        lambda: client.post(
            "/generate", json={"input_ids": [5, 6, 7], "rid": rid, "sampling_params": {**LONG, **params}}
        )
    )
    wait_until(lambda: running(client))
    return thread, box


def test_generate_sent_while_paused_completes_after_continue(client):
    assert client.post("/pause_generation", json={"mode": "abort"}).json() == {
        "message": "Generation paused successfully.", "status": "ok",
    }  # fmt: skip
    thread, box = in_thread(
        lambda: client.post("/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3}})
    )
    time.sleep(0.3)
    assert thread.is_alive(), "a /generate sent while paused must wait, not fail"
    # Held requests are not in the scheduler: a weight-version abort does not reach them.
    client.post("/update_weight_version", json={"new_version": "v1"})
    assert client.post("/continue_generation", json={}).json()["status"] == "ok"
    thread.join(10)
    out = box["value"]
    assert out.status_code == 200 and out.json()["meta_info"]["finish_reason"]["type"] == "length"
    assert out.json()["meta_info"]["weight_version"] == "v1"


def test_pause_abort_finishes_running_requests_with_abort(client):
    thread, box = start_long(client)
    client.post("/pause_generation", json={"mode": "abort"})
    thread.join(10)
    out = box["value"].json()
    assert box["value"].status_code == 200
    assert out["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": "Aborted",
        "status_code": None,
        "err_type": None,
    }
    assert 0 < len(out["output_ids"]) < 600
    client.post("/continue_generation")


def test_abort_request_by_rid_prefix(client):
    thread, box = start_long(client, rid="abc")
    response = client.post("/abort_request", json={"rid": "ab"})
    assert response.status_code == 200 and response.content == b""
    thread.join(10)
    assert box["value"].json()["meta_info"]["finish_reason"]["type"] == "abort"


def test_abort_all_and_empty_rid(client):
    thread, box = start_long(client)
    client.post("/abort_request", json={"rid": ""})  # ignored: the abort is applied before it answers
    generator = client.app.state.engine.generator
    assert thread.is_alive() and running(client) and not any(r._abort for r in generator._running)
    client.post("/abort_request", json={"abort_all": True})
    thread.join(10)
    assert box["value"].json()["meta_info"]["finish_reason"]["message"] == "Aborted"


def test_retract_recomputes_after_continue(client):
    params = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    reference = client.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": params}).json()
    generator = client.app.state.engine.generator
    steps = generator.steps
    thread, box = in_thread(
        lambda: client.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": params})
    )
    wait_until(lambda: generator.steps >= steps + 5)
    client.post("/pause_generation", json={"mode": "retract"})
    wait_until(lambda: not running(client))
    assert client.post("/flush_cache").status_code == 200, "retract frees the cache: flush allowed"
    client.post("/continue_generation")
    thread.join(20)
    out = box["value"].json()
    assert out["meta_info"]["num_retractions"] == 1
    assert out["output_ids"] == reference["output_ids"]


def test_in_place_pause_keeps_the_batch_and_blocks_flush(client):
    generator = client.app.state.engine.generator
    thread, box = start_long(client, max_new_tokens=60)
    client.post("/pause_generation", json={"mode": "in_place"})
    wait_until(lambda: generator.frozen)  # the step in flight when the pause came has completed
    steps = generator.steps
    time.sleep(0.1)
    assert generator.steps == steps and generator.num_requests()["running"] == 1
    flush = client.post("/flush_cache")
    assert flush.status_code == 400 and flush.text == "Flush cache failed."
    assert client.get("/flush_cache", params={"timeout": 0.1}).text == "Timed out waiting for idle state."
    client.post("/continue_generation")
    thread.join(20)
    out = box["value"].json()
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 60}
    assert out["meta_info"]["num_retractions"] == 0
    assert client.post("/flush_cache").text.startswith("Cache flushed.")


def test_duplicate_in_flight_rid_is_rejected(client):
    thread, _ = start_long(client, rid="dup")
    response = client.post("/generate", json={"input_ids": [5], "rid": "dup"})
    assert response.status_code == 400 and "Duplicate request ID" in response.json()["error"]["message"]
    client.post("/abort_request", json={"rid": "dup"})
    thread.join(10)
    same_batch = client.post("/generate", json={"input_ids": [[5], [6]], "rid": ["x", "x"]})
    assert same_batch.status_code == 400


def test_weight_versions_span_a_mid_request_update(client):
    generator = client.app.state.engine.generator
    steps = generator.steps
    thread, box = start_long(client, max_new_tokens=200)
    wait_until(lambda: generator.steps > steps + 5)
    # An in-place pause holds the request mid-way, so the update cannot race its last token on a slow machine.
    client.post("/pause_generation", json={"mode": "in_place"})
    wait_until(lambda: generator.frozen)
    assert generator.num_requests()["running"] == 1, "it finished before the pause: raise max_new_tokens"
    update = client.post("/update_weight_version", json={"new_version": "v2", "abort_all_requests": False})
    assert update.json() == {"success": True, "message": "Weight version updated to v2", "new_version": "v2"}
    client.post("/continue_generation")
    thread.join(20)
    meta = box["value"].json()["meta_info"]
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == ["default", "v2"]
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == 200
    assert meta["weight_version"] == "v2"
    assert client.get("/model_info").json()["weight_version"] == "v2"


def test_update_weight_version_aborts_by_default(client):
    thread, box = start_long(client)
    client.post("/update_weight_version", json={"new_version": "v3"})
    thread.join(10)
    assert box["value"].json()["meta_info"]["finish_reason"]["type"] == "abort"


def test_health_ready_ping(client):
    assert client.get("/health_generate").status_code == 200
    assert client.get("/health").status_code == 200
    assert client.get("/ready").status_code == 200
    client.post("/pause_generation", json={"mode": "retract"})
    assert client.get("/ready").status_code == 503
    assert client.get("/ping").status_code == 200
    assert client.get("/health_generate").status_code == 503
    client.post("/continue_generation")
    assert client.get("/health_generate").status_code == 200 and client.get("/ready").status_code == 200


def test_flush_cache_idle(client):
    response = client.post("/flush_cache")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")


@pytest.mark.parametrize(
    ("path", "method", "headers", "status"),
    [  # SGLang 0.5.23 `srt/utils/auth.py::decide_request_auth` with both keys set
        ("/generate", "post", {}, 401),
        ("/generate", "post", {"Authorization": "Bearer wrong"}, 401),
        ("/generate", "post", {"Authorization": "Bearer user"}, 200),
        ("/generate", "post", {"Authorization": "bearer user"}, 200),  # the scheme is case-insensitive
        (
            "/generate",
            "post",
            {"Authorization": "Bearer admin"},
            401,
        ),  # the admin key opens admin routes only
        ("/model_info", "get", {"Authorization": "Bearer user"}, 200),
        ("/health", "get", {}, 200),
        ("/ready", "get", {}, 200),
        ("/pause_generation", "post", {}, 401),
        ("/pause_generation", "post", {"Authorization": "Bearer user"}, 401),  # api key not accepted
        ("/pause_generation", "post", {"Authorization": "Bearer admin"}, 200),
    ],
)
def test_auth(make_client, path, method, headers, status):
    client = make_client(api_key="user", admin_api_key="admin")
    body = {"input_ids": [5], "sampling_params": {"max_new_tokens": 1}} if path == "/generate" else {}
    kwargs = {"json": body} if method == "post" else {}
    response = getattr(client, method)(path, headers=headers, **kwargs)
    assert response.status_code == status
    if status == 401:
        assert response.json() == {"error": "Unauthorized"}


def test_freeze_gc_moves_every_live_object_out_of_the_collectors_reach(make_client):
    client = make_client(admin_api_key="admin")
    assert client.post("/freeze_gc").status_code == 401  # an admin route, as in SGLang
    gc.unfreeze()
    try:
        for method in ("get", "post"):
            response = getattr(client, method)("/freeze_gc", headers={"Authorization": "Bearer admin"})
            assert response.status_code == 200 and response.text == "Garbage collection frozen.\n"
        assert gc.get_freeze_count() > 10_000  # torch, transformers and the model
        body = {"input_ids": [5], "sampling_params": {"max_new_tokens": 1}}
        assert client.post("/generate", json=body).status_code == 200  # generation is not affected
    finally:
        gc.unfreeze()  # give the rest of the test session its collector back


def test_admin_endpoints_fall_back_to_the_api_key(make_client):
    client = make_client(api_key="user")
    assert client.post("/flush_cache").status_code == 401
    assert client.post("/flush_cache", headers={"Authorization": "Bearer user"}).status_code == 200


def test_admin_key_alone_guards_admin_routes_and_leaves_generate_open(make_client):
    client = make_client(admin_api_key="admin")
    body = {"input_ids": [5], "sampling_params": {"max_new_tokens": 1}}
    assert client.post("/generate", json=body).status_code == 200
    assert client.post("/flush_cache").status_code == 401
    assert client.post("/flush_cache", headers={"Authorization": "Bearer admin"}).status_code == 200


def test_info_endpoints(client):
    info = client.get("/server_info").json()
    assert info["version"] == "0.5.23" and info["tp_size"] == 1 and info["random_seed"] == 1234
    assert info["max_total_num_tokens"] > 0 and info["max_req_input_len"] > 0
    assert isinstance(info["internal_states"], list) and len(info["internal_states"]) == 1
    assert client.get("/get_server_info").json()["version"] == "0.5.23"
    model = client.get("/get_model_info").json()
    assert model["is_generation"] is True and model["weight_version"] == "default"
    assert model["model_path"] == client.app.state.engine.args.model_path
