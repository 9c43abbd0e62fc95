"""Reaching the recipe's engines: set-up calls against a mocked transport."""

from __future__ import annotations

import asyncio

import httpx

from dsv4rl.config.schema import EngineConfig
from dsv4rl.engine_client.client import EngineClient
from dsv4rl.engine_client.engines import freeze_engines_gc


def test_every_engine_is_asked_to_freeze_its_garbage_collector() -> None:
    seen: list[tuple[str, str, str]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.url.host, request.url.path))
        return httpx.Response(200, text="Garbage collection frozen.\n")

    transport = httpx.MockTransport(answer)
    clients = [EngineClient(f"http://engine-{i}", transport=transport, retries=0) for i in range(3)]
    loop = asyncio.new_event_loop()
    try:
        freeze_engines_gc(clients, loop)
    finally:
        loop.close()
    assert sorted(seen) == [("POST", f"engine-{i}", "/freeze_gc") for i in range(3)]
    assert EngineConfig().freeze_gc is True  # on unless a recipe turns it off
