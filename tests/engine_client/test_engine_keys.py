"""The run's engine keys: created once with mode 0600, shared by nodes, chosen by env vars, refused when
they leak or disagree."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import yaml

from dsv4rl.config.choices import RolloutMode
from dsv4rl.config.schema import Config
from dsv4rl.engine_client.engine_keys import (
    ADMIN_KEY_ENV,
    API_KEY_ENV,
    EngineKeys,
    EngineKeysError,
    engine_keys_file,
    engines_need_keys,
    ensure_engine_keys_file,
    read_engine_keys,
    run_engine_keys,
)


def test_engines_beyond_loopback_or_beside_tools_need_keys() -> None:
    cfg = Config()
    assert not engines_need_keys(cfg)
    for host in ("0.0.0.0", "10.1.2.3", "::"):
        cfg.engine.host = host
        assert engines_need_keys(cfg)
    for mode in (RolloutMode.tools, RolloutMode.env):  # the model's or a user's code runs on the node
        cfg = Config()
        cfg.rollout.mode = mode
        assert engines_need_keys(cfg)


def test_random_keys_are_created_once_with_mode_0600(tmp_path: Path) -> None:
    path = ensure_engine_keys_file(tmp_path, env={})
    assert path == engine_keys_file(tmp_path) and path.stat().st_mode & 0o777 == 0o600
    keys = read_engine_keys(path)
    assert len(keys.api_key) == len(keys.admin_api_key) == 64 and keys.api_key != keys.admin_api_key
    assert not keys.api_key.startswith("-") and not keys.admin_api_key.startswith("-")
    assert ensure_engine_keys_file(tmp_path, env={}) == path and read_engine_keys(path) == keys  # kept
    # what SGLang's --config reads: the flags' spellings as keys (it passes each on as `--<key>`)
    assert yaml.safe_load(path.read_text()) == {"api-key": keys.api_key, "admin-api-key": keys.admin_api_key}
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left behind


def test_env_vars_choose_the_keys_and_a_disagreeing_file_is_refused(tmp_path: Path) -> None:
    path = ensure_engine_keys_file(tmp_path, env={ADMIN_KEY_ENV: "chosen", API_KEY_ENV: "user"})
    assert read_engine_keys(path) == EngineKeys(api_key="user", admin_api_key="chosen")
    with pytest.raises(EngineKeysError, match="different admin_api_key"):
        ensure_engine_keys_file(tmp_path, env={ADMIN_KEY_ENV: "other"})
    with pytest.raises(EngineKeysError, match="must not start with '-'"):  # it would read as a flag
        ensure_engine_keys_file(tmp_path / "new", env={ADMIN_KEY_ENV: "-x"})


def test_nodes_racing_for_the_file_agree_on_one_pair(tmp_path: Path) -> None:
    keys: list[EngineKeys] = []
    barrier = threading.Barrier(8)

    def node() -> None:
        barrier.wait()
        keys.append(read_engine_keys(ensure_engine_keys_file(tmp_path, env={})))

    threads = [threading.Thread(target=node) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(keys) == 8 and len(set(keys)) == 1


def test_keys_others_can_read_are_refused(tmp_path: Path) -> None:
    path = ensure_engine_keys_file(tmp_path, env={})
    os.chmod(path, 0o644)
    with pytest.raises(EngineKeysError, match="readable by others.*chmod 600"):
        read_engine_keys(path)
    path.write_text("admin-api-key: x\n")
    os.chmod(path, 0o600)
    with pytest.raises(EngineKeysError, match="lacks api-key or admin-api-key: delete it"):
        read_engine_keys(path)
    path.write_text(
        "admin_api_key: x\napi_key: y\n"
    )  # an earlier dsv4rl's spelling, which SGLang cannot read
    with pytest.raises(EngineKeysError, match="earlier dsv4rl with underscores"):
        read_engine_keys(path)


def test_trainer_reads_the_keys_of_its_run_dir(tmp_path: Path) -> None:
    """The trainer finds the keys where the planner put them (from the config, no environment variable)."""
    ensure_engine_keys_file(tmp_path, env={ADMIN_KEY_ENV: "k", API_KEY_ENV: "u"})
    cfg = Config()
    assert run_engine_keys(cfg, tmp_path) is None  # loopback engines have no keys
    cfg.engine.host = "0.0.0.0"
    assert run_engine_keys(cfg, tmp_path) == EngineKeys(api_key="u", admin_api_key="k")
