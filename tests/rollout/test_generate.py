"""generate_samples against the real reference engine (in-process, with SGLang's deterministic inference
on, as the planner starts it for reproducible sampling), through the real client."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from dsv4rl.config.model_schema import ModelConfig
from dsv4rl.config.schema import SamplingConfig
from dsv4rl.data.problems import Problem
from dsv4rl.engine_client.client import EngineClient, EngineError
from dsv4rl.engine_client.roster import EngineRoster
from dsv4rl.model.model_dir import materialize_model
from dsv4rl.model.tokenizer import load_tokenizer
from dsv4rl.rollout.generate import (
    encode_prompt,
    generate_samples,
    rollout_seed,
    sample_seed,
    sampling_params,
)

PROBLEMS = [Problem("1+2=", "3", "1+2"), Problem("3+3=", "6", "3+3"), Problem("0+1=", "1", "0+1")]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    threads = torch.get_num_threads()
    from dsv4rl.engine.server import create_app

    path = materialize_model(ModelConfig(), str(tmp_path_factory.mktemp("generate") / "tiny"))
    with TestClient(
        create_app(path, random_seed=7, num_threads=1, enable_deterministic_inference=True)
    ) as client:
        assert client.app.state.engine.ready.wait(30)
        yield client
    torch.set_num_threads(threads)


def clients_for(engine: TestClient, count: int, bodies: list | None = None) -> list[EngineClient]:
    def forward(request: httpx.Request) -> httpx.Response:
        if bodies is not None:
            bodies.append(json.loads(request.content))
        response = engine.request(
            request.method, request.url.path, content=request.content, headers=request.headers
        )
        return httpx.Response(response.status_code, headers=response.headers, content=response.content)

    return [
        EngineClient(f"http://engine-{index}", transport=httpx.MockTransport(forward), retries=0)
        for index in range(count)
    ]


def run(engine: TestClient, engines: int, seed: int | None, max_new_tokens: int = 3, bodies=None):
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=max_new_tokens)
    tokenizer = load_tokenizer(ModelConfig())
    clients = clients_for(engine, engines, bodies)
    return asyncio.run(generate_samples(clients, PROBLEMS, tokenizer, 4, sampling, seed=seed))


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
        # the reference engine's spans: every token sampled by the version it was started with
        assert sample.versions == [sample.weight_version] * len(sample.response_ids) and sample.weight_version


def test_a_seed_fixes_the_samples_however_many_engines(engine) -> None:
    one = [sample.response_ids for sample in run(engine, engines=1, seed=5)]
    again = [sample.response_ids for sample in run(engine, engines=1, seed=5)]
    split = [sample.response_ids for sample in run(engine, engines=2, seed=5)]
    other = [sample.response_ids for sample in run(engine, engines=1, seed=6)]
    assert one == again == split
    assert one != other


def test_seeded_samples_of_one_prompt_differ(engine) -> None:
    """Against an engine with deterministic inference, one seed for `n` samples gives `n` copies: every
    GRPO group would have zero advantage. The per-sample form must not."""
    samples = run(engine, engines=1, seed=5, max_new_tokens=6)
    for group in range(len(PROBLEMS)):
        responses = {tuple(s.response_ids) for s in samples if s.group == group}
        assert len(responses) > 1, f"group {group}: all samples identical"


def test_seeded_rollouts_send_one_item_per_sample_each_with_its_seed(engine) -> None:
    bodies: list[dict] = []
    run(engine, engines=2, seed=5, bodies=bodies)
    items = [item for body in bodies for item in zip(body["input_ids"], body["sampling_params"], strict=True)]
    assert len(items) == len(PROBLEMS) * 4
    assert all(params["n"] == 1 for _, params in items)
    seeds = [params["sampling_seed"] for _, params in items]
    assert seeds == [sample_seed(5, p, k) for p in range(len(PROBLEMS)) for k in range(4)]
    assert len(set(seeds)) == len(seeds)
    tokenizer = load_tokenizer(ModelConfig())
    assert [ids for ids, _ in items] == [
        encode_prompt(tokenizer, p.prompt) for p in PROBLEMS for _ in range(4)
    ]


def test_unseeded_rollouts_send_no_seed_and_n_per_prompt(engine) -> None:
    bodies: list[dict] = []
    samples = run(engine, engines=1, seed=None, bodies=bodies)
    (body,) = bodies
    assert body["sampling_params"]["n"] == 4 and "sampling_seed" not in body["sampling_params"]
    assert len(body["input_ids"]) == len(PROBLEMS) and len(samples) == len(PROBLEMS) * 4


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


def test_rollout_seeds_differ_by_step_and_attempt_and_repeat() -> None:
    seeds = {rollout_seed(0, step, attempt) for step in range(1, 50) for attempt in range(3)}
    assert len(seeds) == 49 * 3
    assert rollout_seed(3, 10) == rollout_seed(3, 10)
    assert all(0 <= seed < 2**31 for seed in seeds)


def test_a_lost_engines_call_is_generated_again_whole_on_a_live_one(engine) -> None:
    """Engine 1 dies with its call in flight: the engine generated the samples, the answer never came
    back. The call is sent again to engine 0 (EngineRoster.reroute), so every sample kept was generated,
    whole, by one live engine: the same samples as a run without the fault (the seeds are the samples')."""
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=3)
    tokenizer = load_tokenizer(ModelConfig())
    healthy = asyncio.run(generate_samples(clients_for(engine, 2), PROBLEMS, tokenizer, 4, sampling, seed=9))
    reached: list[str] = []

    def dies_with_the_answer(request: httpx.Request) -> httpx.Response:
        reached.append(request.url.path)
        if request.url.path == "/generate":  # the engine computes, the connection breaks on the way back
            engine.request(request.method, request.url.path, content=request.content, headers=request.headers)
        raise httpx.ReadError("connection reset by peer", request=request)

    live = clients_for(engine, 1)[0]
    dead = EngineClient("http://engine-1", transport=httpx.MockTransport(dies_with_the_answer), retries=1)
    roster = EngineRoster([live, dead], min_alive=1, health_timeout_s=1.0)
    samples = asyncio.run(
        generate_samples(roster.live(), PROBLEMS, tokenizer, 4, sampling, seed=9, reroute=roster.reroute)
    )
    assert reached.count("/generate") == 2 and "/health_generate" in reached  # retried, then probed
    assert roster.down == {1} and roster.resent == 1 and roster.live() == [live]
    assert [(s.group, s.response_ids, s.rollout_logprobs) for s in samples] == [
        (s.group, s.response_ids, s.rollout_logprobs) for s in healthy
    ]


def test_an_engine_that_answers_its_health_probe_keeps_its_error(engine) -> None:
    """A call refused by an engine that is alive (a bad request) is the call's error: raised, not resent."""
    tokenizer = load_tokenizer(ModelConfig())
    clients = clients_for(engine, 2)
    roster = EngineRoster(clients, min_alive=1, health_timeout_s=5.0)
    bad = SamplingConfig(temperature=1.0, max_new_tokens=-1)
    with pytest.raises(EngineError, match="/generate"):
        asyncio.run(generate_samples(clients, PROBLEMS, tokenizer, 4, bad, seed=9, reroute=roster.reroute))
    assert roster.down == set() and roster.resent == 0
