"""What the reference engine reports about its model: SGLang 0.5.23's /model_info keys, and enough for the
trainer's connect-time check (`dsv4rl.sync.served_model`) to pass on the model it serves."""

from __future__ import annotations

import asyncio

from fastapi.testclient import TestClient

from dsv4rl.config.choices import RolloutEngineKind
from dsv4rl.sync.served_model import SGLANG_MODEL_INFO_KEYS, check_served_models


class Answers:
    """The engine's answers as the check's client (an `EngineAPI` with its two info calls)."""

    base_url = "http://testserver"

    def __init__(self, client: TestClient) -> None:
        self.client = client

    async def model_info(self) -> dict:
        return self.client.get("/model_info").json()

    async def server_info(self) -> dict:
        return self.client.get("/server_info").json()


def test_model_info_has_sglangs_keys_and_no_more(client: TestClient) -> None:
    info = client.get("/model_info").json()
    assert set(info) == SGLANG_MODEL_INFO_KEYS
    assert info["model_type"] == "deepseek_v4" and info["architectures"] == ["DeepseekV4ForCausalLM"]


def test_the_connect_check_passes_on_the_model_it_serves(client: TestClient, model_dir: str) -> None:
    assert client.get("/server_info").json()["dtype"] == "auto"  # SGLang's field: float32 here
    loop = asyncio.new_event_loop()
    try:
        check_served_models([Answers(client)], RolloutEngineKind.reference, model_dir, loop)
    finally:
        loop.close()
