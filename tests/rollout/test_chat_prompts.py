"""The engines get exactly the prompt ids the chat format rendered (and the trainer scores the same ids):
ids encoded once with the problem are sent as they are; others are rendered by the recipe's format."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from dsv4rl.config.choices import ChatFormat
from dsv4rl.config.model_schema import ModelConfig
from dsv4rl.config.schema import SamplingConfig
from dsv4rl.data.chat_format import ChatSettings, PromptRenderer
from dsv4rl.data.problems import Problem
from dsv4rl.engine_client.client import EngineClient
from dsv4rl.model.model_dir import materialize_model
from dsv4rl.model.tokenizer import load_tokenizer
from dsv4rl.rollout.generate import encode_prompts, generate_samples, prompt_token_ids

PROBLEMS = [Problem("1+2=", "3", "1+2"), Problem("3+3=", "6", "3+3")]
ANSWERING = ChatSettings(ChatFormat.deepseek_v4, thinking=False)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    threads = torch.get_num_threads()
    from dsv4rl.engine.server import create_app

    path = materialize_model(ModelConfig(), str(tmp_path_factory.mktemp("chat") / "tiny"))
    with TestClient(create_app(path, random_seed=7, num_threads=1)) as client:
        assert client.app.state.engine.ready.wait(30)
        yield client
    torch.set_num_threads(threads)


def sent_ids(engine: TestClient, problems: list[Problem], renderer: PromptRenderer | None):
    bodies: list[dict] = []

    def forward(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        response = engine.request(
            request.method, request.url.path, content=request.content, headers=request.headers
        )
        return httpx.Response(response.status_code, headers=response.headers, content=response.content)

    client = EngineClient("http://engine-0", transport=httpx.MockTransport(forward), retries=0)
    tokenizer = load_tokenizer(ModelConfig())
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=2)
    samples = asyncio.run(
        generate_samples([client], problems, tokenizer, 2, sampling, seed=3, renderer=renderer)
    )
    return [ids for body in bodies for ids in body["input_ids"]], samples


def test_the_engine_and_the_samples_get_the_rendered_ids(engine) -> None:
    tokenizer = load_tokenizer(ModelConfig())
    renderer = PromptRenderer(tokenizer, ANSWERING)
    rendered = renderer.encode([p.prompt for p in PROBLEMS])
    assert rendered[0] == [0, 27, 5, 14, 6, 18, 28, 30]  # <bos><｜User｜>1+2=<｜Assistant｜></think>
    sent, samples = sent_ids(engine, PROBLEMS, renderer)
    assert sent == [ids for ids in rendered for _ in range(2)]
    assert [s.prompt_ids for s in samples] == sent  # what the trainer scores
    plain, _ = sent_ids(engine, PROBLEMS, None)  # chat_format none: BOS + the text, as before
    assert plain == [ids for ids in encode_prompts(tokenizer, [p.prompt for p in PROBLEMS]) for _ in range(2)]


def test_ids_encoded_with_the_problem_are_sent_as_they_are(engine) -> None:
    tokenizer = load_tokenizer(ModelConfig())
    renderer = PromptRenderer(tokenizer, ANSWERING)
    own = [replace(PROBLEMS[0], prompt_ids=(0, 5, 14, 5, 18)), PROBLEMS[1]]
    assert prompt_token_ids(tokenizer, own, renderer) == [[0, 5, 14, 5, 18], renderer.encode(["3+3="])[0]]
    sent, _ = sent_ids(engine, own, renderer)
    assert sent[:2] == [[0, 5, 14, 5, 18]] * 2
