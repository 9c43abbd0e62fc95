"""The real server process: `python -m dsv4rl.engine` comes up, answers /health_generate and /generate."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

from dsv4rl.engine_client.engine_keys import ADMIN_KEY_ENV, API_KEY_ENV, ensure_engine_keys_file
from free_ports import free_port


def test_server_process(model_dir, tmp_path):
    """Started as the planner starts it on a cluster: the keys from a --config file (SGLang's form)."""
    port = free_port()
    log = tmp_path / "engine.log"
    key_file = ensure_engine_keys_file(tmp_path, env={ADMIN_KEY_ENV: "admin-key", API_KEY_ENV: "api-key"})
    command = [
        sys.executable, "-m", "dsv4rl.engine", "--model-path", model_dir, "--port", str(port),
        "--num-threads", "1", "--random-seed", "3", "--weight-version", "w0", "--config", str(key_file),
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
        user, admin = {"Authorization": "Bearer api-key"}, {"Authorization": "Bearer admin-key"}
        assert httpx.post(f"{url}/generate", json=body, timeout=30).status_code == 401
        out = httpx.post(f"{url}/generate", json=body, headers=user, timeout=30).json()
        assert [len(o["output_ids"]) for o in out] == [4, 4]
        assert out[0]["meta_info"]["weight_version"] == "w0"
        for headers in ({}, user):
            assert httpx.post(f"{url}/flush_cache", headers=headers, timeout=30).status_code == 401
        assert httpx.post(f"{url}/flush_cache", headers=admin, timeout=30).status_code == 200
        assert httpx.get(f"{url}/server_info", timeout=30).status_code == 401  # it would show the keys
        info = httpx.get(f"{url}/server_info", headers=user, timeout=30).json()
        assert info["admin_api_key"] == info["api_key"] == "***"
        assert "The server is fired up and ready to roll!" in log.read_text()
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)


def test_config_file_flags_merge_like_sglang(tmp_path):
    from dsv4rl.engine.args import parse_args

    config = tmp_path / "flags.yaml"
    config.write_text("admin-api-key: k\nrandom-seed: 5\nenable-deterministic-inference: true\n")
    args = parse_args(["--model-path", "m", "--config", str(config), "--random-seed", "9"])
    assert args["admin_api_key"] == "k" and args["enable_deterministic_inference"] is True
    assert args["random_seed"] == 9  # the command line wins over the file
    config.write_text("no-such-flag: 1\n")
    with pytest.raises(SystemExit, match="unknown option 'no-such-flag'"):
        parse_args(["--model-path", "m", "--config", str(config)])
    config.write_text("admin_api_key: k\n")  # SGLang would pass on --admin_api_key, which no parser knows
    with pytest.raises(SystemExit, match="spelled with dashes: 'admin-api-key'"):
        parse_args(["--model-path", "m", "--config", str(config)])
