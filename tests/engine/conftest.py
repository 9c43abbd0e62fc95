"""Shared fixtures: one tiny model directory per session, and a fresh app + client per test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from dsv4rl.config.model_schema import ModelConfig
from dsv4rl.model.model_dir import materialize_model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return materialize_model(ModelConfig(), str(tmp_path_factory.mktemp("engine") / "tiny"))


@pytest.fixture
def make_client(model_dir: str) -> Iterator[Callable[..., TestClient]]:
    """make_client(**server_args) -> a started TestClient (warmup done); all are closed at teardown."""
    stack: list[TestClient] = []
    threads = torch.get_num_threads()

    def make(**kwargs: Any) -> TestClient:
        kwargs.setdefault("random_seed", 1234)
        kwargs.setdefault("num_threads", 1)
        from dsv4rl.engine.server import create_app

        client = TestClient(create_app(model_dir, **kwargs))
        client.__enter__()
        stack.append(client)
        assert client.app.state.engine.ready.wait(30), "engine warmup did not finish"
        return client

    yield make
    for client in reversed(stack):
        client.__exit__(None, None, None)
    torch.set_num_threads(threads)  # the engine sets it process-wide; leave other tests as they were


@pytest.fixture
def client(make_client: Callable[..., TestClient]) -> TestClient:
    return make_client()
