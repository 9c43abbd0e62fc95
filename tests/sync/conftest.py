"""Fixtures for the weight-sync tests: real reference engine processes serving a tiny model."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from sync_helpers import ENGINE_SEED, ENGINE_TIMEOUT_S, free_port

from dsv4rl.config.schema import ModelConfig
from dsv4rl.model.tiny import materialize_model

ENGINES = 2


@pytest.fixture(scope="module")
def engine_urls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """Two real reference engines (`python -m dsv4rl.engine`) serving the tiny model from ENGINE_SEED."""
    root = tmp_path_factory.mktemp("sync_engine")
    model_dir = materialize_model(ModelConfig(init_seed=ENGINE_SEED), str(root / "tiny"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DSV4RL_WEIGHT_SYNC_TIMEOUT_S": str(ENGINE_TIMEOUT_S)}
    engines = []
    try:
        for index in range(ENGINES):
            port, log = free_port(), root / f"engine{index}.log"
            command = [sys.executable, "-m", "dsv4rl.engine", "--model-path", model_dir, "--port", str(port),
                       "--num-threads", "1", "--random-seed", "0", "--log-level", "warning"]  # fmt: skip
            with open(log, "w") as out:
                process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
            engines.append((process, f"http://127.0.0.1:{port}", log))
        deadline = time.monotonic() + 120
        for process, url, log in engines:
            while not _healthy(url):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"engine {url} did not come up: {log.read_text()[-3000:]}")
                time.sleep(0.2)
        yield [url for _, url, _ in engines]
    finally:
        for process, _, _ in engines:
            process.terminate()
        for process, _, _ in engines:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=15)


@pytest.fixture(scope="module")
def engine_url(engine_urls: list[str]) -> str:
    return engine_urls[0]


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
