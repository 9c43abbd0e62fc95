"""`truncation_ratio` counts the responses the cap cut off (finish reason "length"), not those that ended at
the cap with a stop token: the real reference engine (in-process) reports "stop" for a stop token sampled
as the cap's last token, and the eval reads its finish reasons. Only the transport is in between; it sets
the stop tokens the engine is asked for (every token, or none)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from dsv4rl.config.compose import compose
from dsv4rl.engine_client.client import EngineClient
from dsv4rl.eval.data import eval_problems
from dsv4rl.eval.run import eval_grader, evaluate_on_engines
from dsv4rl.model.model_dir import materialize_model
from dsv4rl.model.tokenizer import run_tokenizer

SAMPLES = 4


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    threads = torch.get_num_threads()
    from dsv4rl.engine.server import create_app

    cfg = compose("tiny_arith")
    path = materialize_model(cfg.model, str(tmp_path_factory.mktemp("truncation") / "tiny"))
    with TestClient(create_app(path, random_seed=3, num_threads=1)) as client:
        assert client.app.state.engine.ready.wait(30)
        yield client
    torch.set_num_threads(threads)


def evaluate(engine: TestClient, tmp_path, stop_ids: list[int] | None) -> dict:
    """The tiny_arith eval (one-token cap) of 4 problems; `stop_ids`: the stop tokens the engine gets
    (None: as the eval asks, the tokenizer's)."""

    def forward(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if stop_ids is not None and request.url.path == "/generate":
            params = body["sampling_params"]
            for one in params if isinstance(params, list) else [params]:
                one["stop_token_ids"], one["ignore_eos"] = stop_ids, not stop_ids
        response = engine.request(request.method, request.url.path, json=body, headers={})
        return httpx.Response(response.status_code, headers=response.headers, content=response.content)

    cfg = compose("tiny_arith", [f"eval.samples_per_problem={SAMPLES}", f"run.dir={tmp_path}"])
    client = EngineClient("http://engine-0", transport=httpx.MockTransport(forward), retries=0)
    grader = eval_grader(cfg)
    loop = asyncio.new_event_loop()
    try:
        problems = eval_problems(cfg)[:4]
        return evaluate_on_engines(cfg, problems, [client], run_tokenizer(cfg.model), grader, loop, seed=5)
    finally:
        loop.run_until_complete(client.aclose())
        loop.close()
        grader.close()


@pytest.mark.slow
def test_a_stop_token_at_the_cap_is_not_truncation(engine, tmp_path) -> None:
    vocab = len(run_tokenizer(compose("tiny_arith").model))
    stopped = evaluate(engine, tmp_path, list(range(vocab)))  # whatever is sampled is a stop token
    assert stopped["response_len_mean"] == 1.0 and stopped["sampling"]["max_new_tokens"] == 1
    assert stopped["truncation_ratio"] == 0.0
    assert all(row["truncated"] == 0 for row in stopped["per_problem"])

    cut = evaluate(engine, tmp_path, [])  # no stop token at all: every response is cut by the cap
    assert cut["response_len_mean"] == 1.0 and cut["truncation_ratio"] == 1.0
    assert all(row["truncated"] == SAMPLES for row in cut["per_problem"])
