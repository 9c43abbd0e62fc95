"""return_routed_experts / return_indexer_topk in the reference engine, in SGLang 0.5.23's format: base64
int32 in meta_info, one row per forwarded position (seqlen - 1), routed experts from
routed_experts_start_len; silently absent without the server flag or the request's ask."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsv4rl.model.replay import ChoiceRecorder, hash_routed_layers, indexer_layers, score_routed_layers
from dsv4rl.wire.choices import decode_rows, encode_int32

PROMPT = [3 + i % 27 for i in range(30)]


def generate(client, **fields) -> dict:  # noqa: ANN001
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}, **fields}
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def full_forward_choices(model: torch.nn.Module, sequence: list[int]) -> tuple[np.ndarray, np.ndarray]:
    recorder = ChoiceRecorder(model, routed=True, indexer=True)
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([sequence]), use_cache=False)
        routes, topk = recorder.take()
    finally:
        recorder.close()
    return routes[0].numpy(), topk[0].numpy()


@pytest.fixture
def capturing(make_client):  # noqa: ANN001, ANN201
    return make_client(enable_return_routed_experts=True, enable_return_indexer_topk=True)


def test_choices_cover_every_forwarded_position_as_sglang_lays_them_out(capturing) -> None:  # noqa: ANN001
    answer = generate(capturing, return_routed_experts=True, return_indexer_topk=True)
    model = capturing.app.state.engine.model
    config = model.config
    sequence = PROMPT + answer["output_ids"]
    rows = len(sequence) - 1  # the last sampled token is never forwarded
    meta = answer["meta_info"]
    routes = decode_rows(meta["routed_experts"], rows, "routed_experts")
    topk = decode_rows(meta["indexer_topk"], rows, "indexer_topk")
    assert routes.shape == (rows, config.num_hidden_layers * config.num_experts_per_tok)
    assert topk.shape == (rows, len(indexer_layers(config)) * config.index_topk)
    routes = routes.reshape(rows, config.num_hidden_layers, -1)
    topk = topk.reshape(rows, len(indexer_layers(config)), -1)
    # prefill + cached decoding chose what one forward over the sequence chooses
    full_routes, full_topk = full_forward_choices(model, sequence[:-1])
    for layer in score_routed_layers(config):
        assert np.array_equal(np.sort(routes[:, layer], -1), np.sort(full_routes[:, layer], -1))
    for layer in hash_routed_layers(config):
        assert not routes[:, layer].any()  # never captured by SGLang: zeros
    assert np.array_equal(np.sort(topk, -1), np.sort(full_topk, -1))
    assert (topk[:3] == -1).all()  # no compressed entry visible yet
    assert encode_int32(routes) == meta["routed_experts"]  # base64 of C-order little-endian int32


def test_routed_experts_start_len_drops_the_leading_rows(capturing) -> None:  # noqa: ANN001
    full = generate(
        capturing, return_routed_experts=True, sampling_params={"max_new_tokens": 4, "temperature": 0}
    )
    tail = generate(
        capturing,
        return_routed_experts=True,
        routed_experts_start_len=25,
        sampling_params={"max_new_tokens": 4, "temperature": 0},
    )
    assert full["output_ids"] == tail["output_ids"]
    rows = len(PROMPT) + len(full["output_ids"]) - 1
    whole = decode_rows(full["meta_info"]["routed_experts"], rows, "routed_experts")
    part = decode_rows(tail["meta_info"]["routed_experts"], rows - 25, "routed_experts")
    assert np.array_equal(part, whole[25:])
    assert "indexer_topk" not in tail["meta_info"]  # not asked


def test_absent_without_the_server_flag_or_the_ask(make_client, capturing) -> None:  # noqa: ANN001
    plain = make_client()
    meta = generate(plain, return_routed_experts=True, return_indexer_topk=True)["meta_info"]
    assert "routed_experts" not in meta and "indexer_topk" not in meta  # SGLang: silently absent
    meta = generate(capturing)["meta_info"]
    assert "routed_experts" not in meta and "indexer_topk" not in meta


def test_batched_requests_get_their_own_rows(capturing) -> None:  # noqa: ANN001
    body = {
        "input_ids": [PROMPT, PROMPT[:12]],
        "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
        "return_routed_experts": True,
    }
    answers = capturing.post("/generate", json=body).json()
    for prompt, answer in zip([PROMPT, PROMPT[:12]], answers, strict=True):
        rows = len(prompt) + len(answer["output_ids"]) - 1
        assert decode_rows(answer["meta_info"]["routed_experts"], rows, "routed_experts").shape[0] == rows


@pytest.mark.parametrize(
    ("fields", "status", "message"),
    [
        ({"return_routed_experts": "yes"}, 400, "expected a boolean"),
        ({"return_indexer_topk": 1}, 400, "expected a boolean"),
        ({"return_routed_experts": True, "routed_experts_start_len": 1.5}, 400, "expected i64"),
        ({"return_routed_experts": True, "routed_experts_start_len": -1}, 400, "is lower than 0"),
        (
            {"return_routed_experts": True, "routed_experts_start_len": 31},
            400,
            "higher than the number of input",
        ),
    ],
)
def test_bad_fields_are_refused(capturing, fields: dict, status: int, message: str) -> None:  # noqa: ANN001
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}, **fields}
    response = capturing.post("/generate", json=body)
    assert response.status_code == status
    assert message in response.text
