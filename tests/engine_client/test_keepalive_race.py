"""The keep-alive race against the reference engine: a request sent on a kept-alive connection just as the
server closes it fails with a read error. The client sends it again on a fresh connection, so only what
persists past its retries is an engine failure; with no retries the same race is an `EngineError`.

Between the client and the engine (uvicorn, in a thread, on a real socket) a proxy plays the server's
keep-alive timer deterministically: a request that arrives on a connection idle for longer than
`IDLE_S` gets the connection reset (RST), as a server that closed it a moment before would."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest
import torch
import uvicorn

from dsv4rl.config.compose import compose
from dsv4rl.engine_client.client import KEEPALIVE_EXPIRY_S, EngineClient, EngineError
from dsv4rl.model.model_dir import materialize_model

IDLE_S = 0.3  # the proxy's "server keep-alive": shorter than the client's own expiry, so the race happens
UVICORN_KEEPALIVE_S = 5  # uvicorn's default timeout_keep_alive, as SGLang's SGLANG_TIMEOUT_KEEP_ALIVE


class IdleResetProxy:
    """Forwards TCP to `upstream`; resets a connection when a request arrives after `idle_s` of silence."""

    def __init__(self, upstream: int, idle_s: float) -> None:
        self.upstream, self.idle_s = upstream, idle_s
        self.resets = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self.listener.accept()
                threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        server = socket.create_connection(("127.0.0.1", self.upstream))
        last = [time.monotonic(), False]  # last activity, whether a request went through
        threading.Thread(target=self._back, args=(server, client, last), daemon=True).start()
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                if last[1] and time.monotonic() - last[0] > self.idle_s:
                    self.resets += 1
                    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    break  # closed with a reset, the request unanswered
                last[0], last[1] = time.monotonic(), True
                server.sendall(data)
        for sock in (client, server):
            with contextlib.suppress(OSError):
                sock.close()

    @staticmethod
    def _back(server: socket.socket, client: socket.socket, last: list) -> None:
        with contextlib.suppress(OSError):
            while data := server.recv(65536):
                client.sendall(data)
                last[0] = time.monotonic()


@pytest.fixture(scope="module")
def engine_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    from dsv4rl.engine.server import create_app

    threads = torch.get_num_threads()
    cfg = compose("tiny_arith")
    path = materialize_model(cfg.model, str(tmp_path_factory.mktemp("keepalive") / "tiny"))
    app = create_app(path, random_seed=0, num_threads=1)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not (server.started and app.state.engine.ready.is_set()):
        assert time.monotonic() < deadline, "the reference engine did not start"
        time.sleep(0.05)
    yield port
    server.should_exit = True
    thread.join(timeout=15)
    torch.set_num_threads(threads)


def generate_twice(port: int, retries: int) -> tuple[list[dict], IdleResetProxy]:
    proxy = IdleResetProxy(port, IDLE_S)
    client = EngineClient(f"http://127.0.0.1:{proxy.port}", retries=retries, backoff_s=0.01)

    async def go() -> list[dict]:
        try:
            first = await client.generate(input_ids=[0, 5], sampling_params={"max_new_tokens": 1})
            await asyncio.sleep(2 * IDLE_S)  # idle past the server's keep-alive, within the client's
            second = await client.generate(input_ids=[0, 6], sampling_params={"max_new_tokens": 1})
            return [first, second]
        finally:
            await client.aclose()

    return asyncio.run(go()), proxy


def test_a_request_caught_by_the_keepalive_race_is_sent_again_on_a_fresh_connection(engine_port: int) -> None:
    answers, proxy = generate_twice(engine_port, retries=2)
    assert proxy.resets == 1  # the race happened, on the reused connection
    assert [len(a["output_ids"]) for a in answers] == [1, 1]


def test_without_retries_the_race_is_an_engine_error(engine_port: int) -> None:
    with pytest.raises(
        EngineError, match=r"/generate: connection lost: (ReadError|RemoteProtocolError|WriteError)"
    ):
        generate_twice(engine_port, retries=0)


def test_the_client_lets_idle_connections_go_before_the_server_does() -> None:
    assert KEEPALIVE_EXPIRY_S < UVICORN_KEEPALIVE_S
    assert uvicorn.Config(app=None).timeout_keep_alive == UVICORN_KEEPALIVE_S  # the engines' server
