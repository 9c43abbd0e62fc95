"""The engines' keys: who may push weights (admin key) and who may use the engines at all (api key).

SGLang guards its weight, pause, flush and abort routes with `--admin-api-key`; an engine that binds
anything but loopback without one takes weight updates from anyone on the network. The admin key alone is
not enough: SGLang 0.5.23's `/server_info` (an ordinary route, open unless `--api-key` is set) returns its
resolved arguments and launch command, admin key included (`srt/utils/common.py::build_server_info`). So
such engines get both keys, and only the run's trainer holds them.

The keys are per run: the admin key is $DSV4RL_ENGINE_ADMIN_API_KEY when set (the same on every node), the
api key $DSV4RL_ENGINE_API_KEY, each else random. They live in `<run.dir>/engine-keys.yaml` (mode 0600),
a file SGLang reads with `--config` (so nothing shows in `ps`) and the trainer reads from the run dir.
Its keys are spelled as the flags are, `api-key` and `admin-api-key`: SGLang 0.5.23 turns each key into
`--<key>` verbatim (`sglang/srt/utils/server_args_config_parser.py`, `_add_scalar_arg`), and argparse knows
no `--admin_api_key`.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from dsv4rl.config.choices import RolloutMode
from dsv4rl.config.schema import Config

ADMIN_KEY_ENV = "DSV4RL_ENGINE_ADMIN_API_KEY"  # set it to choose the admin key (the same on every node)
API_KEY_ENV = "DSV4RL_ENGINE_API_KEY"
KEYS_FILE = "engine-keys.yaml"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
# EngineKeys field -> the key in the file (the flag's spelling without `--`)
FILE_KEYS = {"api_key": "api-key", "admin_api_key": "admin-api-key"}


class EngineKeysError(ValueError):
    """The keys file cannot be trusted or read; the message names the file and the fix."""


@dataclass(frozen=True)
class EngineKeys:
    api_key: str
    admin_api_key: str


def engines_need_keys(cfg: Config) -> bool:
    """Engines must refuse requests without the run's keys when other machines can reach them, and when
    other people's code runs beside them: a tool's or an environment's code (the model's code in the
    python tool, whatever its isolation) could otherwise POST weights to a loopback engine."""
    return cfg.engine.host not in LOOPBACK or cfg.rollout.mode != RolloutMode.single_turn


def engine_keys_file(run_dir: Path) -> Path:
    return Path(run_dir) / KEYS_FILE


def _chosen(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name) or None
    if value is not None and (value.startswith("-") or any(c.isspace() for c in value)):
        # SGLang turns --config entries into command-line arguments: "-..." would read as a flag.
        raise EngineKeysError(f"${name} must not start with '-' or contain spaces: choose another key")
    return value


def ensure_engine_keys_file(run_dir: Path, env: Mapping[str, str] | None = None) -> Path:
    """Create the keys file once per run (atomically: nodes sharing the run dir race for it), or check the
    existing one against the keys the environment chooses."""
    env = os.environ if env is None else env
    path = engine_keys_file(run_dir)
    env_names = {"api_key": API_KEY_ENV, "admin_api_key": ADMIN_KEY_ENV}
    wanted = {name: _chosen(env, env_name) for name, env_name in env_names.items()}
    if not path.exists():
        keys = {
            FILE_KEYS[name]: key or secrets.token_hex(32) for name, key in wanted.items()
        }  # hex: never "-..."
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".engine-keys.")  # mode 0600
        try:
            with os.fdopen(fd, "w") as handle:
                yaml.safe_dump(keys, handle)
            with contextlib.suppress(FileExistsError):  # another node was first: use its file
                os.link(tmp, path)
        finally:
            os.unlink(tmp)
    held = read_engine_keys(path)
    for name, key in wanted.items():
        if key is not None and getattr(held, name) != key:
            raise EngineKeysError(
                f"{path} holds a different {name} than ${env_names[name]}: engines and trainer would "
                f"disagree; delete the file (a new run) or unset ${env_names[name]}"
            )
    return path


def read_engine_keys(path: Path) -> EngineKeys:
    """The keys from a file only its owner can read (a readable secret is refused)."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise EngineKeysError(f"cannot read the engines' keys {path}: {error}") from error
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise EngineKeysError(
            f"{path} (the engines' keys) is readable by others (mode {stat.S_IMODE(mode):04o}): "
            f"`chmod 600 {path}`, or delete it to get new keys"
        )
    if not isinstance(data, dict) or not all(
        isinstance(data.get(k), str) and data[k] for k in FILE_KEYS.values()
    ):
        older = isinstance(data, dict) and any(k in data for k in FILE_KEYS)
        why = (
            " (written by an earlier dsv4rl with underscores, which SGLang's --config cannot read)"
            if older
            else ""
        )
        raise EngineKeysError(
            f"{path} lacks api-key or admin-api-key{why}: delete it and start again for new keys"
        )
    return EngineKeys(api_key=data[FILE_KEYS["api_key"]], admin_api_key=data[FILE_KEYS["admin_api_key"]])


def run_engine_keys(cfg: Config, run_dir: Path) -> EngineKeys | None:
    """The trainer's side: the run's keys when its engines need them (beyond loopback), else None. The
    file's place follows from the run dir, as the planner's does: nothing is handed over by environment."""
    return read_engine_keys(engine_keys_file(run_dir)) if engines_need_keys(cfg) else None
