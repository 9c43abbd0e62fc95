"""Model directories of the tiny model: built once from the seed, reused when the settings match, cached.

The tiny model has no checkpoint to download: the launcher builds it from its seed, and engines and
trainers load the same files, exactly as they would the released checkpoint. Building needs transformers,
whose import alone takes seconds; so a built directory is also kept in a per-user
cache (`DSV4RL_CACHE_DIR`, default `~/.cache/dsv4rl`; set it to an empty string to turn the cache off),
keyed by the settings, the torch/transformers/safetensors versions and dsv4rl's model and quantization
code, and later runs copy it without importing transformers. This module imports neither torch nor
transformers.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
from dataclasses import asdict
from importlib import metadata
from pathlib import Path

from dsv4rl.config.model_schema import ModelConfig
from dsv4rl.config.schema import QuantConfig
from dsv4rl.model.release_config import RELEASE_KEYS, release_key_problems

MANIFEST_FILE = "dsv4rl-model.json"
CACHE_ENV = "DSV4RL_CACHE_DIR"
_PACKAGE = Path(__file__).resolve().parent.parent
_BUILD_CODE = ("model", "quant")  # dsv4rl's code that decides the files' bytes
_LIBRARIES = ("torch", "transformers", "safetensors")


class ModelDirMismatch(ValueError):
    """A model directory built earlier from other settings than the recipe's."""


def source_model_dir(run_dir: str | Path) -> Path:
    """`dsv4rl align` with the tiny model: the unquantized weights the trainer holds (quant=none)."""
    return Path(run_dir) / "model-source"


def manifest(model_config: ModelConfig, quant: QuantConfig) -> str:
    keys = {"name": quant.name.value, "block_size": list(quant.block_size)}
    keys["expert_scale_dtype"] = quant.expert_scale_dtype.value
    return json.dumps({"model": asdict(model_config), "quant": keys}, sort_keys=True, default=str)


def check_model_dir(model_config: ModelConfig, directory: str | Path, quant: QuantConfig) -> bool:
    """True when `directory` already holds this model in this format; ModelDirMismatch when it holds
    another, or its config.json lacks or contradicts the release's keys; False when there is nothing to
    reuse."""
    target = Path(directory)
    if not (target / "config.json").exists():
        return False
    built = (target / MANIFEST_FILE).read_text() if (target / MANIFEST_FILE).exists() else None
    if built != manifest(model_config, quant):
        raise ModelDirMismatch(
            f"{target} holds a model built from other settings (model.* or quant=) than this recipe's "
            f"(quant={quant.name.value}); choose a new run.dir, or delete that directory to rebuild it"
        )
    config = json.loads((target / "config.json").read_text())
    missing = [key for key in RELEASE_KEYS if key not in config]
    problems = release_key_problems(config)
    if missing or problems:
        what = f"lacks the release's keys {missing}" if missing else "; ".join(problems)
        raise ModelDirMismatch(
            f"{target}/config.json {what} (SGLang reads those keys, not transformers'): it was written by "
            "an earlier dsv4rl or edited since; delete that directory to rebuild it (the same weights, from "
            "the seed)"
        )
    return True


def materialize_model(model_config: ModelConfig, directory: str, quant: QuantConfig | None = None) -> str:
    """Write the tiny model as a native DeepSeek-V4 checkpoint in `quant`'s format, with its tokenizer.

    A directory built before is reused only when it was built from the same settings (recorded in
    dsv4rl-model.json); otherwise it is copied from the cache, or built and then cached.
    """
    quant = quant if quant is not None else QuantConfig()
    target = Path(directory)
    if check_model_dir(model_config, target, quant):
        return str(target)
    _remove_stale_partials(target)
    # One build dir per process: the nodes of a multi-node run share the run dir and build at the same time.
    partial = _partial(target)
    entry = cache_entry(model_config, quant)
    if entry is not None and (entry / MANIFEST_FILE).is_file():
        shutil.copytree(entry, partial)
    else:
        from dsv4rl.model.tiny import write_tiny_model

        write_tiny_model(model_config, partial, quant)
        (partial / MANIFEST_FILE).write_text(manifest(model_config, quant))
        if entry is not None:
            _store(partial, entry)
    try:
        partial.rename(target)
    except OSError:  # another node was first; its copy is built from the same seed and settings
        shutil.rmtree(partial)
        if not check_model_dir(model_config, target, quant):
            raise
    return str(target)


def cache_entry(model_config: ModelConfig, quant: QuantConfig) -> Path | None:
    """Where this model's cached directory is (it may not exist yet); None with the cache turned off."""
    root = os.environ.get(CACHE_ENV)
    if root is None:
        root = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dsv4rl")
    if not root:
        return None
    digest = hashlib.sha256(manifest(model_config, quant).encode())
    for library in _LIBRARIES:
        digest.update(f"{library}=={metadata.version(library)}".encode())
    for folder in _BUILD_CODE:
        for source in sorted((_PACKAGE / folder).glob("*.py")):
            digest.update(source.name.encode() + source.read_bytes())
    return Path(root).expanduser() / "tiny-models" / digest.hexdigest()[:24]


def _store(built: Path, entry: Path) -> None:
    """Copy a fresh build into the cache; a cache that cannot be written only costs the next run a build."""
    staging = _partial(entry)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(built, staging)
        staging.rename(entry)
    except OSError:  # read-only home, full disk, or another process stored it first
        shutil.rmtree(staging, ignore_errors=True)


def _partial(target: Path) -> Path:
    return target.with_name(f"{target.name}.partial-{socket.gethostname()}-{os.getpid()}")


def _remove_stale_partials(target: Path) -> None:
    """Builds interrupted earlier on this host; a live process's build, or another host's, is left alone."""
    prefix, ours = f"{target.name}.partial", f"-{socket.gethostname()}-"
    for stale in target.parent.glob(f"{prefix}*"):
        owner = stale.name.removeprefix(prefix)  # "" (older builds) or "-<host>-<pid>"
        if owner.startswith(ours):
            pid = owner.rsplit("-", 1)[-1]
            if pid.isdigit() and _process_alive(int(pid)):
                continue
        elif owner:
            continue
        shutil.rmtree(stale, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
