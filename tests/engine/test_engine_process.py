"""The real server process: `python -m dsv4rl.engine` comes up, answers /health_generate and /generate."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_server_process(model_dir, tmp_path):
    port = free_port()
    log = tmp_path / "engine.log"
    command = [
        sys.executable, "-m", "dsv4rl.engine", "--model-path", model_dir, "--port", str(port),
        "--num-threads", "1", "--random-seed", "3", "--weight-version", "w0",
    ]  # fmt: skip
    with open(log, "w") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert process.poll() is None, f"engine exited: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"engine not healthy in time: {log.read_text()[-3000:]}"
            try:
                if httpx.get(f"{url}/health_generate", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        body = {
            "input_ids": [[5, 6, 7], [8, 9]],
            "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
        }
        out = httpx.post(f"{url}/generate", json=body, timeout=30).json()
        assert [len(o["output_ids"]) for o in out] == [4, 4]
        assert out[0]["meta_info"]["weight_version"] == "w0"
        assert "The server is fired up and ready to roll!" in log.read_text()
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)
