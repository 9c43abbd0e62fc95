"""The engines' admin key: who may push weights, pause, flush and abort.

SGLang guards those routes with `--admin-api-key`; an engine that binds anything but loopback without one
takes weight updates from anyone on the network. dsv4rl gives such engines a per-run secret: the value of
$DSV4RL_ENGINE_ADMIN_API_KEY when set (the same on every node), else a random key created once per run.
It lives in `<run.dir>/engine-admin-key.yaml` (mode 0600), a file SGLang reads with `--config` (so the key
never shows in `ps`) and the trainer reads through $DSV4RL_ENGINE_ADMIN_KEY_FILE.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path

import yaml

from dsv4rl.config.schema import Config

KEY_ENV = "DSV4RL_ENGINE_ADMIN_API_KEY"  # set it to choose the key (every node must see the same value)
KEY_FILE_ENV = "DSV4RL_ENGINE_ADMIN_KEY_FILE"  # where the trainer reads it (set by the planner)
KEY_FILE = "engine-admin-key.yaml"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


class AdminKeyError(ValueError):
    """The key file cannot be trusted or read; the message names the file and the fix."""


def engines_need_admin_key(cfg: Config) -> bool:
    """Engines reachable from other machines must refuse weight pushes without the key."""
    return cfg.engine.host not in LOOPBACK


def admin_key_file(run_dir: Path) -> Path:
    return Path(run_dir) / KEY_FILE


def ensure_admin_key_file(run_dir: Path, env: Mapping[str, str] | None = None) -> Path:
    """Create the key file once per run (atomically: nodes sharing the run dir race for it), or check the
    existing one. The key is $DSV4RL_ENGINE_ADMIN_API_KEY when set, else 32 random bytes."""
    env = os.environ if env is None else env
    path = admin_key_file(run_dir)
    wanted = env.get(KEY_ENV) or None
    if wanted is not None and (wanted.startswith("-") or any(c.isspace() for c in wanted)):
        # SGLang turns --config entries into command-line arguments: "-..." would read as a flag.
        raise AdminKeyError(f"${KEY_ENV} must not start with '-' or contain spaces: choose another key")
    if not path.exists():
        key = wanted or secrets.token_hex(32)  # hex: never starts with "-"
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".engine-admin-key.")  # mode 0600
        try:
            with os.fdopen(fd, "w") as handle:
                yaml.safe_dump({"admin_api_key": key}, handle)
            with contextlib.suppress(FileExistsError):  # another node was first: use its file
                os.link(tmp, path)
        finally:
            os.unlink(tmp)
    key = read_admin_key(path)
    if wanted is not None and key != wanted:
        raise AdminKeyError(
            f"{path} holds a different admin key than ${KEY_ENV}: engines and trainer would disagree; delete "
            f"the file (a new run) or unset ${KEY_ENV}"
        )
    return path


def read_admin_key(path: Path) -> str:
    """The key from a file only its owner can read (a readable secret is refused)."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise AdminKeyError(f"cannot read the engine admin key {path}: {error}") from error
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise AdminKeyError(
            f"{path} (the engines' admin key) is readable by others (mode {stat.S_IMODE(mode):04o}): "
            f"`chmod 600 {path}`, or delete it to get a new key"
        )
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("admin_api_key"), str)
        or not data["admin_api_key"]
    ):
        raise AdminKeyError(f"{path} has no admin_api_key entry: delete it and start again to get a new key")
    return data["admin_api_key"]


def admin_key_from_env(env: Mapping[str, str] | None = None) -> str | None:
    """The trainer's side: the key file the planner named, or None (engines on loopback have no key)."""
    env = os.environ if env is None else env
    path = env.get(KEY_FILE_ENV)
    return read_admin_key(Path(path)) if path else None
