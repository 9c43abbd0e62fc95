"""The engine's routing and indexer choices through the rollout: asked for in every /generate, kept on each
sample (one row per forwarded position), packed per input position into the train batch."""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from dsv4rl.config.model_schema import ModelConfig
from dsv4rl.config.schema import SamplingConfig
from dsv4rl.data.problems import Problem
from dsv4rl.engine_client.client import EngineClient
from dsv4rl.model.model_dir import materialize_model
from dsv4rl.model.replay import NO_CHOICE
from dsv4rl.model.tokenizer import load_tokenizer
from dsv4rl.rollout.choices import ChoiceRequest, attach_choices
from dsv4rl.rollout.generate import generate_samples
from dsv4rl.samples import Sample
from dsv4rl.train.batch import TrainBatch
from dsv4rl.wire.choices import encode_int32

PROBLEMS = [Problem("1+2=", "3", "1+2"), Problem("3+3=", "6", "3+3")]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:  # noqa: ANN001
    return materialize_model(ModelConfig(), str(tmp_path_factory.mktemp("choices") / "tiny"))


def rollout(model_path: str, asked: ChoiceRequest, **server) -> tuple[list[Sample], list[dict]]:  # noqa: ANN003
    from dsv4rl.engine.server import create_app

    threads = torch.get_num_threads()
    bodies: list[dict] = []
    with TestClient(create_app(model_path, random_seed=7, num_threads=1, **server)) as engine:
        assert engine.app.state.engine.ready.wait(30)

        def forward(request: httpx.Request) -> httpx.Response:
            bodies.append(json.loads(request.content))
            response = engine.request(request.method, request.url.path, content=request.content)
            return httpx.Response(response.status_code, headers=response.headers, content=response.content)

        client = EngineClient("http://engine", transport=httpx.MockTransport(forward), retries=0)
        sampling = SamplingConfig(temperature=1.0, max_new_tokens=3)
        tokenizer = load_tokenizer(ModelConfig())
        try:
            samples = asyncio.run(generate_samples([client], PROBLEMS, tokenizer, 2, sampling, choices=asked))
        finally:
            torch.set_num_threads(threads)
    return samples, bodies


def test_samples_keep_the_engines_choices(model_path: str) -> None:
    samples, bodies = rollout(
        model_path,
        ChoiceRequest(routed_experts=True, indexer_topk=True),
        enable_return_routed_experts=True,
        enable_return_indexer_topk=True,
    )
    assert all(b["return_routed_experts"] and b["return_indexer_topk"] for b in bodies)
    assert all(b["routed_experts_start_len"] == 0 for b in bodies)
    for sample in samples:
        rows = len(sample.prompt_ids) + len(sample.response_ids) - 1
        assert sample.routed_experts.shape == (rows, 3 * 2)  # 3 layers x top-2
        assert sample.indexer_topk.shape == (rows, 1 * 16)  # 1 CSA layer x index_topk 16
    batch = TrainBatch.from_samples(samples, pad_id=2)
    b, t = batch.input_ids.shape
    assert batch.routed_experts.shape == (b, t, 6) and batch.indexer_topk.shape == (b, t, 16)
    for row, sample in enumerate(samples):
        rows = sample.routed_experts.shape[0]
        assert np.array_equal(batch.routed_experts[row, :rows].numpy(), sample.routed_experts)
        assert (batch.routed_experts[row, rows:] == NO_CHOICE).all()  # last token, padding
    trimmed = batch.trimmed()
    assert trimmed.routed_experts.shape[1] == trimmed.input_ids.shape[1]
    assert batch.shard(1, 2).routed_experts.shape[0] == b // 2


def test_plain_requests_ask_for_nothing(model_path: str) -> None:
    samples, bodies = rollout(model_path, ChoiceRequest())
    assert not any("return_routed_experts" in b or "return_indexer_topk" in b for b in bodies)
    assert all(s.routed_experts is None and s.indexer_topk is None for s in samples)
    assert TrainBatch.from_samples(samples, pad_id=2).routed_experts is None


def test_an_engine_without_the_flag_is_named(model_path: str) -> None:
    with pytest.raises(ValueError, match="--enable-return-routed-experts"):
        rollout(model_path, ChoiceRequest(routed_experts=True))


def test_rows_must_match_the_forwarded_positions() -> None:
    sample = Sample(0, [0, 5, 6], [7, 1], [-0.1, -0.2], "", "stop")
    meta = {"routed_experts": encode_int32(np.zeros((3, 6), dtype=np.int32))}
    with pytest.raises(ValueError, match="not a whole number of rows for 4 forwarded positions"):
        attach_choices(sample, meta, ChoiceRequest(routed_experts=True))
    meta = {"routed_experts": encode_int32(np.arange(24, dtype=np.int32).reshape(4, 6))}
    assert attach_choices(sample, meta, ChoiceRequest(routed_experts=True)).routed_experts[3, 5] == 23
