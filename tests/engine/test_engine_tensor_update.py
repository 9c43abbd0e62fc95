"""/update_weights_from_tensor on the reference engine: SGLang 0.5.23's fields and answers, the three load
formats, and every refusal before a byte is written (outside a session, a malformed or unsafe payload, the
wrong number of TP entries, a tensor the engine does not hold)."""

from __future__ import annotations

import base64
import os
import pickle

import pytest
import torch
from engine_helpers import changed_weights, tensor_update

from dsv4rl.model.tokenizer import build_char_tokenizer
from dsv4rl.wire.checksum import checksums

EMBED = f"[{len(build_char_tokenizer())}, 64]"  # the tiny model's embedding: its tokenizer's vocabulary x 64
OUTSIDE = "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"


def held_checksums(client) -> dict[str, str]:
    return client.post("/weights_checker", json={"action": "checksum"}).json()["ranks"][0]["checksums"]


def held(client) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in client.app.state.engine.weights.state().items()}


@pytest.mark.parametrize("load_format", [None, "direct", "flattened_bucket"])
def test_update_loads_exactly_what_was_sent(client, load_format):
    new = changed_weights(held(client))
    assert set(checksums(new).values()).isdisjoint(held_checksums(client).values())
    entry, buffer = tensor_update(new, load_format)
    assert client.post("/begin_weight_update", json={}).status_code == 200
    body = {"serialized_named_tensors": [entry], "load_format": load_format, "flush_cache": True,
            "weight_version": "t1", "abort_all_requests": False, "selector": "all",
            "torch_empty_cache": False}  # fmt: skip
    response = client.post("/update_weights_from_tensor", json=body)
    del buffer
    assert response.status_code == 200, response.text
    assert response.json() == {"success": True, "message": "Success Weight version updated to t1."}
    assert client.post("/end_weight_update", json={}).status_code == 200
    assert held_checksums(client) == checksums(new)
    assert client.get("/model_info").json()["weight_version"] == "t1"
    out = client.post("/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})
    assert out.status_code == 200 and out.json()["meta_info"]["weight_version"] == "t1"


def test_partial_update_in_two_requests_without_version(client):
    new = changed_weights(held(client))
    names = sorted(new)
    client.post("/begin_weight_update", json={})
    for part in (names[: len(names) // 2], names[len(names) // 2 :]):
        entry, _buffer = tensor_update({n: new[n] for n in part})
        response = client.post("/update_weights_from_tensor", json={"serialized_named_tensors": [entry]})
        assert response.json() == {"success": True, "message": "Success"}
    client.post("/end_weight_update", json={})
    assert held_checksums(client) == checksums(new)
    assert client.get("/model_info").json()["weight_version"] == "default"


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def encoded(obj) -> str:
    return base64.b64encode(pickle.dumps(obj)).decode()


def test_refusals_write_nothing(client):
    before = held_checksums(client)
    tensors = held(client)
    good, _buffer = tensor_update({"embed.weight": tensors["embed.weight"] + 1})
    outside = client.post("/update_weights_from_tensor", json={"serialized_named_tensors": [good]})
    assert outside.status_code == 400 and outside.json() == {"success": False, "message": OUTSIDE}
    client.post("/begin_weight_update", json={})
    wrong_dtype, _b2 = tensor_update({"embed.weight": tensors["embed.weight"].double()})
    unknown, _b3 = tensor_update({"model.embed.weight": tensors["embed.weight"]})
    flat, _b4 = tensor_update({"embed.weight": tensors["embed.weight"]}, "flattened_bucket")
    cases = [
        ({"serialized_named_tensors": ["%%%"]}, "not base64"),
        ({"serialized_named_tensors": [base64.b64encode(b"no pickle").decode()]}, "cannot unpickle"),
        ({"serialized_named_tensors": [encoded(Evil())]}, "refused global posix.system"),
        ({"serialized_named_tensors": [encoded({"a": 1})]}, "wants a list of (name, tensor)"),
        ({"serialized_named_tensors": [encoded([("embed.weight", 3)])]}, "not a (name, tensor) pair"),
        ({"serialized_named_tensors": [good], "load_format": "flattened_bucket"}, "wants {flattened_tensor"),
        ({"serialized_named_tensors": [flat]}, "wants a list of (name, tensor)"),
        ({"serialized_named_tensors": [good, good]}, "2 entries, but the engine has 1 tensor-parallel"),
        ({"serialized_named_tensors": [good], "load_format": "my.loader"}, "Unknown load_format=my.loader"),
        ({"serialized_named_tensors": [wrong_dtype]}, f"embed.weight: the engine holds float32 {EMBED}"),
        ({"serialized_named_tensors": [unknown]}, "model.embed.weight: the engine holds no tensor"),
    ]
    for body, message in cases:
        response = client.post("/update_weights_from_tensor", json=body)
        assert response.status_code == 400 and response.json()["success"] is False, body
        assert message in response.json()["message"], (message, response.json()["message"])
    not_strings = client.post("/update_weights_from_tensor", json={"serialized_named_tensors": [1]})
    assert not_strings.status_code == 400 and not_strings.json()["type"] == "Bad Request"
    missing = client.post("/update_weights_from_tensor", json={"load_format": None})
    assert missing.status_code == 400 and missing.json()["type"] == "Bad Request"
    assert held_checksums(client) == before


def test_flattened_metadata_must_describe_the_buffer(client):
    from types import SimpleNamespace

    from dsv4rl.wire.tensor_payload import serialize

    embed = client.app.state.engine.weights.state()["embed.weight"]
    buffer = embed.clone().reshape(-1).view(torch.uint8)
    size = buffer.numel()
    meta = SimpleNamespace(name="embed.weight", shape=embed.shape, dtype=torch.float32,
                           start_idx=0, end_idx=size - 4, numel=size - 4)  # fmt: skip
    client.post("/begin_weight_update", json={})
    body = {
        "serialized_named_tensors": [serialize({"flattened_tensor": buffer, "metadata": [meta]})],
        "load_format": "flattened_bucket",
    }
    response = client.post("/update_weights_from_tensor", json=body)
    assert response.status_code == 400 and f"do not hold float32 {EMBED}" in response.json()["message"]
