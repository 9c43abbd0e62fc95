"""Weight endpoints: session rules enforced before the receiver is touched, versions, checksums."""

from __future__ import annotations

import pytest
from engine_helpers import RecordingReceiver, in_thread, wait_until

from dsv4rl.config.model_schema import ModelConfig
from dsv4rl.model.model_dir import materialize_model
from dsv4rl.model.native_checkpoint import read_tensors
from dsv4rl.wire.checksum import checksums, engine_checksum, overall_checksum

UPDATE = {"names": ["embed.weight"], "dtypes": ["float32"], "shapes": [[27, 64]], "flush_cache": False}
OUTSIDE = "must run between begin_weight_update() and end_weight_update()"


@pytest.fixture
def fake() -> RecordingReceiver:
    return RecordingReceiver()


@pytest.fixture
def wclient(make_client, fake):
    return make_client(receiver=fake)


def test_update_outside_a_session_never_reaches_the_receiver(wclient, fake):
    response = wclient.post("/update_weights_from_distributed", json=UPDATE)
    assert response.status_code == 400
    assert response.json()["success"] is False and OUTSIDE in response.json()["message"]
    tensor = wclient.post("/update_weights_from_tensor", json={"serialized_named_tensors": []})
    assert tensor.status_code == 400 and OUTSIDE in tensor.json()["message"]
    assert fake.calls == []


def test_session_lifecycle(wclient, fake):
    assert wclient.post("/end_weight_update", json={}).status_code == 400
    begin = wclient.post("/begin_weight_update", json={})
    assert begin.status_code == 200 and begin.json()["success"] is True
    again = wclient.post("/begin_weight_update", json={})
    assert again.status_code == 400 and "already open" in again.json()["message"]
    response = wclient.post("/update_weights_from_distributed", json={**UPDATE, "weight_version": "v7"})
    assert response.status_code == 200
    assert response.json() == {
        "success": True, "message": "Succeeded to update parameter online. Weight version updated to v7.",
    }  # fmt: skip
    assert fake.calls == [
        ("receive", (["embed.weight"], ["float32"], [[27, 64]], "weight_update_group", None))
    ]
    tensor = wclient.post("/update_weights_from_tensor", json={"serialized_named_tensors": ["x"]})
    assert tensor.status_code == 400 and "not base64" in tensor.json()["message"]  # inside the session
    assert wclient.post("/end_weight_update", json={}).status_code == 200
    assert wclient.post("/end_weight_update", json={}).status_code == 400
    assert wclient.post("/update_weights_from_distributed", json=UPDATE).status_code == 400
    assert len(fake.calls) == 1
    assert wclient.get("/model_info").json()["weight_version"] == "v7"
    out = wclient.post("/generate", json={"input_ids": [5], "sampling_params": {"max_new_tokens": 2}}).json()
    assert out["meta_info"]["weight_version"] == "v7"


def test_receiver_failure_is_a_400_and_keeps_the_version(make_client):
    fake = RecordingReceiver(fail_with=ValueError("embed.weight: unknown dtype 'torch.bfloat16'"))
    client = make_client(receiver=fake)
    client.post("/begin_weight_update", json={})
    response = client.post("/update_weights_from_distributed", json={**UPDATE, "weight_version": "v9"})
    assert response.status_code == 400 and "torch.bfloat16" in response.json()["message"]
    assert client.get("/model_info").json()["weight_version"] == "default"


def test_group_endpoints(wclient, fake):
    body = {
        "master_address": "127.0.0.1",
        "master_port": 29999,
        "rank_offset": 1,
        "world_size": 2,
        "backend": "gloo",
    }
    response = wclient.post("/init_weights_update_group", json=body)
    assert response.json() == {"success": True, "message": "Succeeded to initialize custom process group."}
    assert fake.calls[0] == ("init_group", ("127.0.0.1", 29999, 1, 2, "weight_update_group", "gloo"))
    missing = wclient.post("/init_weights_update_group", json={"master_address": "x"})
    assert missing.status_code == 400 and missing.json()["type"] == "Bad Request"
    unknown = wclient.post("/destroy_weights_update_group", json={"group_name": "nope"})
    assert (
        unknown.status_code == 400
        and unknown.json()["message"] == "The group to be destroyed does not exist."
    )
    assert wclient.post("/destroy_weights_update_group", json={}).json()["success"] is True
    assert fake.calls[-1] == ("destroy_group", ("weight_update_group",))


def test_update_waits_for_in_flight_requests_when_not_paused(wclient, fake):
    generator = wclient.app.state.engine.generator
    seen: list[dict] = []
    fake.receive = lambda *args: seen.append(generator.num_requests())  # type: ignore[method-assign]
    wclient.post("/begin_weight_update", json={})
    body = {
        "input_ids": [5, 6],
        "sampling_params": {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True},
    }
    thread, box = in_thread(lambda: wclient.post("/generate", json=body))
    wait_until(lambda: generator.num_requests()["running"] == 1)
    update = wclient.post("/update_weights_from_distributed", json={**UPDATE, "weight_version": "v1"})
    assert update.status_code == 200
    thread.join(10)
    assert seen == [{"held": 0, "waiting": 0, "running": 0}]
    assert [s["version"] for s in box["value"].json()["meta_info"]["weight_versions"]] == ["default"]


def test_flush_refused_while_requests_live_in_place(wclient, fake):
    generator = wclient.app.state.engine.generator
    body = {
        "input_ids": [5, 6],
        "sampling_params": {"max_new_tokens": 1000, "temperature": 0, "ignore_eos": True},
    }
    thread, box = in_thread(lambda: wclient.post("/generate", json=body))
    wait_until(lambda: generator.num_requests()["running"] == 1)
    wclient.post("/pause_generation", json={"mode": "in_place"})
    wclient.post("/begin_weight_update", json={})
    response = wclient.post("/update_weights_from_distributed", json={**UPDATE, "flush_cache": True})
    assert response.status_code == 400 and "Weights were updated" in response.json()["message"]
    assert len(fake.calls) == 1
    wclient.post("/abort_request", json={"abort_all": True})
    thread.join(10)
    assert box["value"].json()["meta_info"]["finish_reason"]["type"] == "abort"


def test_real_receiver_refuses_before_any_broadcast(client):
    """With the real WeightReceiver: no group yet, so the update fails fast with a 400."""
    client.post("/begin_weight_update", json={})
    response = client.post("/update_weights_from_distributed", json=UPDATE)
    assert response.status_code == 400 and "init_weights_update_group" in response.json()["message"]
    unknown = client.post("/destroy_weights_update_group", json={"group_name": "g"})
    assert unknown.status_code == 400


def test_checksums_and_update_from_disk(client, model_dir, tmp_path):
    """Checksums are over the held tensors, in SGLang's response shape; the digests combine as SGLang's."""
    body = client.post("/weights_checker", json={"action": "checksum"}).json()
    expected = checksums(read_tensors(model_dir))  # what the engine started from, as stored
    rank = body["ranks"][0]
    assert body["success"] is True and rank["checksums"] == expected
    assert rank["per_gpu_checksum"] == overall_checksum(expected)
    assert body["per_engine_checksum"] == engine_checksum([rank["per_gpu_checksum"]])
    assert rank["parallelism_info"] == [
        {"role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "pp_rank": 0, "pp_size": 1,
         "rank": 0, "size": 1}
    ]  # fmt: skip
    assert "layers.1.ffn.experts.3.w2.weight" in expected and "layers.0.ffn.gate.tid2eid" in expected
    skipped = client.post("/weights_checker", json={"action": "checksum", "skip_tensor_list": ["experts"]})
    kept = skipped.json()["ranks"][0]["checksums"]
    assert (
        kept and not any("experts" in n for n in kept) and "layers.1.ffn.shared_experts.w1.weight" not in kept
    )
    assert client.post("/weights_checker", json={"action": "snapshot"}).json()["success"] is True
    assert client.post("/weights_checker", json={"action": "compare"}).json()["success"] is True

    other = materialize_model(ModelConfig(init_seed=1), str(tmp_path / "other"))
    client.post("/weights_checker", json={"action": "snapshot"})
    response = client.post("/update_weights_from_disk", json={"model_path": other, "weight_version": "disk"})
    assert response.status_code == 200 and response.json()["success"] is True
    after = client.post("/weights_checker", json={"action": "checksum"}).json()
    assert after["ranks"][0]["checksums"] == checksums(read_tensors(other))
    assert client.post("/weights_checker", json={"action": "compare"}).status_code == 400
    assert client.get("/model_info").json()["weight_version"] == "disk"
    unknown = client.post("/weights_checker", json={"action": "frobnicate"})
    assert unknown.status_code == 400 and "Unsupported action" in unknown.json()["message"]


def test_update_from_disk_refuses_another_format(client, tmp_path):
    from dsv4rl.config.choices import QuantMode
    from dsv4rl.config.schema import QuantConfig

    before = client.post("/weights_checker", json={"action": "checksum"}).json()["per_engine_checksum"]
    fp8 = materialize_model(
        ModelConfig(init_seed=1), str(tmp_path / "fp8"), QuantConfig(name=QuantMode.fp8_mxfp4)
    )
    response = client.post("/update_weights_from_disk", json={"model_path": fp8})
    assert response.status_code == 400 and "the engine holds float32" in response.json()["message"]
    assert (
        client.post("/weights_checker", json={"action": "checksum"}).json()["per_engine_checksum"] == before
    )


def test_reset_tensors_then_compare_catches_every_tensor(client):
    """SGLang's way to check a full sync: snapshot, reset, (sync), compare. Without the sync, all differ."""
    assert client.post("/weights_checker", json={"action": "snapshot"}).json()["success"] is True
    reset = client.post("/weights_checker", json={"action": "reset_tensors", "skip_tensor_list": ["tid2eid"]})
    assert reset.json()["success"] is True
    compare = client.post("/weights_checker", json={"action": "compare"})
    assert compare.status_code == 400 and "tensors differ from the snapshot" in compare.json()["message"]
    held = client.app.state.engine.weights.state()
    assert "tid2eid" not in compare.json()["message"]
    assert len(held) > 100


def test_without_the_admin_key_no_update_gets_through(make_client, tmp_path):
    """An engine started with --admin-api-key: weight pushes without the key are refused and change nothing;
    with it they go through (the same routes SGLang 0.5.23 guards)."""
    fake = RecordingReceiver()
    client = make_client(admin_api_key="k3y", receiver=fake)
    admin = {"Authorization": "Bearer k3y"}
    checksum = lambda: client.post(  # noqa: E731
        "/weights_checker", json={"action": "checksum"}, headers=admin
    ).json()["per_engine_checksum"]
    before = checksum()
    other = materialize_model(ModelConfig(init_seed=1), str(tmp_path / "other"))
    for path, body in [
        ("/begin_weight_update", {}),
        ("/update_weights_from_distributed", UPDATE),
        ("/update_weights_from_disk", {"model_path": other}),
        ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                        "world_size": 2}),
        ("/pause_generation", {"mode": "abort"}),
        ("/weights_checker", {"action": "reset_tensors"}),
    ]:  # fmt: skip
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            response = client.post(path, json=body, headers=headers)
            assert response.status_code == 401 and response.json() == {"error": "Unauthorized"}, path
    assert fake.calls == [] and checksum() == before
    assert client.get("/model_info").json()["weight_version"] == "default"
    assert client.get("/health_generate").status_code == 200  # probes stay open, generation too
    assert (
        client.post(
            "/generate", json={"input_ids": [5], "sampling_params": {"max_new_tokens": 1}}
        ).status_code
        == 200
    )
    response = client.post("/update_weights_from_disk", json={"model_path": other}, headers=admin)
    assert response.status_code == 200 and checksum() != before
