"""generate_samples against the real reference engine (in-process), through the real client."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from dsv4rl.config.schema import ModelConfig, SamplingConfig
from dsv4rl.data.problems import Problem
from dsv4rl.model.tiny import load_tokenizer, materialize_model
from dsv4rl.rollout.client import EngineClient
from dsv4rl.rollout.generate import encode_prompt, generate_samples, sampling_params

PROBLEMS = [Problem("1+2=", "3", "1+2"), Problem("3+3=", "6", "3+3"), Problem("0+1=", "1", "0+1")]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    threads = torch.get_num_threads()
    from dsv4rl.engine.server import create_app

    path = materialize_model(ModelConfig(), str(tmp_path_factory.mktemp("generate") / "tiny"))
    with TestClient(create_app(path, random_seed=7, num_threads=1)) as client:
        assert client.app.state.engine.ready.wait(30)
        yield client
    torch.set_num_threads(threads)


def clients_for(engine: TestClient, count: int) -> list[EngineClient]:
    def forward(request: httpx.Request) -> httpx.Response:
        response = engine.request(
            request.method, request.url.path, content=request.content, headers=request.headers
        )
        return httpx.Response(response.status_code, headers=response.headers, content=response.content)

    return [
        EngineClient(f"http://engine-{index}", transport=httpx.MockTransport(forward), retries=0)
        for index in range(count)
    ]


def run(engine: TestClient, engines: int, seed: int | None, max_new_tokens: int = 3):
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=max_new_tokens)
    tokenizer = load_tokenizer(ModelConfig())
    return asyncio.run(
        generate_samples(clients_for(engine, engines), PROBLEMS, tokenizer, 4, sampling, seed=seed)
    )


def test_samples_are_prompt_major_with_one_logprob_per_token(engine) -> None:
    samples = run(engine, engines=2, seed=11)
    assert [sample.group for sample in samples] == [0] * 4 + [1] * 4 + [2] * 4
    tokenizer = load_tokenizer(ModelConfig())
    for sample in samples:
        assert sample.prompt_ids == encode_prompt(tokenizer, PROBLEMS[sample.group].prompt)
        assert sample.prompt_ids[0] == tokenizer.bos_token_id
        assert sample.answer == PROBLEMS[sample.group].answer
        assert 1 <= len(sample.response_ids) <= 3
        assert len(sample.rollout_logprobs) == len(sample.response_ids)
        assert all(logprob <= 0.0 for logprob in sample.rollout_logprobs)
        assert sample.finish_reason in ("stop", "length")


def test_a_seed_fixes_the_samples_however_many_engines(engine) -> None:
    one = [sample.response_ids for sample in run(engine, engines=1, seed=5)]
    again = [sample.response_ids for sample in run(engine, engines=1, seed=5)]
    other = [sample.response_ids for sample in run(engine, engines=1, seed=6)]
    assert one == again
    assert one != other


def test_sampling_params_use_only_sglang_keys() -> None:
    params = sampling_params(SamplingConfig(top_k=5), stop_token_ids=[1], n=8, seed=3)
    assert params == {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 5,
        "max_new_tokens": 128,
        "stop_token_ids": [1],
        "n": 8,
        "sampling_seed": 3,
    }
    assert "sampling_seed" not in sampling_params(SamplingConfig(), [1], 1, None)
