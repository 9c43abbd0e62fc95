"""The per-run admin key: created once with mode 0600, shared by nodes, chosen by an env var, refused when
it leaks or disagrees."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import yaml

from dsv4rl.config.schema import Config
from dsv4rl.launcher.admin_key import (
    KEY_ENV,
    KEY_FILE_ENV,
    AdminKeyError,
    admin_key_file,
    admin_key_from_env,
    engines_need_admin_key,
    ensure_admin_key_file,
    read_admin_key,
)


def test_only_engines_beyond_loopback_need_a_key() -> None:
    cfg = Config()
    assert not engines_need_admin_key(cfg)
    for host in ("0.0.0.0", "10.1.2.3", "::"):
        cfg.engine.host = host
        assert engines_need_admin_key(cfg)


def test_a_random_key_is_created_once_with_mode_0600(tmp_path: Path) -> None:
    path = ensure_admin_key_file(tmp_path, env={})
    assert path == admin_key_file(tmp_path) and path.stat().st_mode & 0o777 == 0o600
    key = read_admin_key(path)
    assert len(key) == 64 and not key.startswith("-")
    assert ensure_admin_key_file(tmp_path, env={}) == path and read_admin_key(path) == key  # kept
    assert yaml.safe_load(path.read_text()) == {"admin_api_key": key}  # what SGLang's --config reads
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left behind


def test_the_env_var_chooses_the_key_and_a_disagreeing_file_is_refused(tmp_path: Path) -> None:
    path = ensure_admin_key_file(tmp_path, env={KEY_ENV: "chosen"})
    assert read_admin_key(path) == "chosen"
    with pytest.raises(AdminKeyError, match="different admin key"):
        ensure_admin_key_file(tmp_path, env={KEY_ENV: "other"})
    with pytest.raises(AdminKeyError, match="must not start with '-'"):  # it would read as a flag
        ensure_admin_key_file(tmp_path / "new", env={KEY_ENV: "-x"})


def test_nodes_racing_for_the_file_agree_on_one_key(tmp_path: Path) -> None:
    keys: list[str] = []
    barrier = threading.Barrier(8)

    def node() -> None:
        barrier.wait()
        keys.append(read_admin_key(ensure_admin_key_file(tmp_path, env={})))

    threads = [threading.Thread(target=node) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(keys) == 8 and len(set(keys)) == 1


def test_a_key_others_can_read_is_refused(tmp_path: Path) -> None:
    path = ensure_admin_key_file(tmp_path, env={})
    os.chmod(path, 0o644)
    with pytest.raises(AdminKeyError, match="readable by others.*chmod 600"):
        read_admin_key(path)
    path.write_text("nothing: here\n")
    os.chmod(path, 0o600)
    with pytest.raises(AdminKeyError, match="no admin_api_key"):
        read_admin_key(path)


def test_trainer_reads_the_key_the_planner_names(tmp_path: Path) -> None:
    path = ensure_admin_key_file(tmp_path, env={KEY_ENV: "k"})
    assert admin_key_from_env({KEY_FILE_ENV: str(path)}) == "k"
    assert admin_key_from_env({}) is None
