"""Fixtures for the weight-sync tests: real reference engine processes serving a tiny model."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sync_helpers import ENGINE_SEED, ENGINE_TIMEOUT_S

from dsv4rl.config.choices import QuantMode
from dsv4rl.config.model_schema import ModelConfig
from dsv4rl.config.schema import QuantConfig
from dsv4rl.model.model_dir import materialize_model
from free_ports import free_port

ENGINES = 2


@contextlib.contextmanager
def running_engines(root: Path, quants: list[QuantMode], extra_args: list[str] = ()) -> Iterator[list[str]]:
    """One real reference engine (`python -m dsv4rl.engine`) per entry, each serving the tiny model from
    ENGINE_SEED as a native checkpoint in that quant mode (with `extra_args`); yields their URLs."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DSV4RL_WEIGHT_SYNC_TIMEOUT_S": str(ENGINE_TIMEOUT_S)}
    engines = []
    try:
        for index, quant in enumerate(quants):
            model_dir = root / f"tiny-{quant.value}"
            if not model_dir.exists():
                materialize_model(ModelConfig(init_seed=ENGINE_SEED), str(model_dir), QuantConfig(name=quant))
            port, log = free_port(), root / f"engine{index}.log"
            command = [sys.executable, "-m", "dsv4rl.engine", "--model-path", str(model_dir),
                       "--port", str(port), "--num-threads", "1", "--random-seed", "0",
                       "--log-level", "warning", *extra_args]  # fmt: skip
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


# The engines serve the whole session (test_stages, test_verify and test_weight_sync share them): starting
# them costs seconds each, a test costs less. A test never relies on what an earlier one left: each pushes a
# model of its own seed and compares with that, or with the weights it read from the engine first.
@pytest.fixture(scope="session")
def engine_urls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """Two engines serving the unquantized (quant=none) tiny model."""
    with running_engines(tmp_path_factory.mktemp("sync_engine"), [QuantMode.none] * ENGINES) as urls:
        yield urls


@pytest.fixture(scope="session")
def engine_url(engine_urls: list[str]) -> str:
    return engine_urls[0]


@pytest.fixture(scope="session")
def quantized_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[QuantMode, str]]:
    """One engine per quant mode, each started from a checkpoint in that format."""
    modes = list(QuantMode)
    with running_engines(tmp_path_factory.mktemp("quant_engines"), modes) as urls:
        yield dict(zip(modes, urls, strict=True))


@pytest.fixture(scope="module")
def colocated_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[QuantMode, str]]:
    """Engines a colocated trainer can release and refill (--enable-memory-saver): quant none and the
    release format fp8_mxfp4."""
    modes = [QuantMode.none, QuantMode.fp8_mxfp4]
    root = tmp_path_factory.mktemp("colocated_engines")
    with running_engines(root, modes, extra_args=["--enable-memory-saver"]) as urls:
        yield dict(zip(modes, urls, strict=True))


@pytest.fixture
def emulating_engine(tmp_path: Path) -> Iterator[str]:
    """A fresh engine emulating SGLang's non-idempotent post-processing (a failed push spends it)."""
    emulate = ["--emulate-non-idempotent-postprocess"]
    with running_engines(tmp_path, [QuantMode.none], extra_args=emulate) as urls:
        yield urls[0]


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
