"""The tiny model's directories: built once, then copied from the cache without transformers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import dsv4rl.model.tiny as tiny
from dsv4rl.config.choices import QuantMode
from dsv4rl.config.model_schema import ModelConfig
from dsv4rl.config.schema import QuantConfig
from dsv4rl.model.model_dir import CACHE_ENV, cache_entry, materialize_model


def files(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def refuse_to_build(*_args) -> None:
    raise AssertionError("built again although the cache holds this model")


def test_a_second_directory_is_copied_from_the_cache_bit_for_bit(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    first = Path(materialize_model(ModelConfig(), str(tmp_path / "a")))
    entry = cache_entry(ModelConfig(), QuantConfig())
    assert entry is not None and entry.parent == tmp_path / "cache" / "tiny-models" and entry.is_dir()
    monkeypatch.setattr(tiny, "write_tiny_model", refuse_to_build)
    second = Path(materialize_model(ModelConfig(), str(tmp_path / "b")))
    assert files(second) == files(first) and "model.safetensors" in files(first)
    assert not list(tmp_path.glob("*.partial*")) and not list(entry.parent.glob("*.partial*"))


def test_other_settings_have_their_own_entry(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    entries = {
        cache_entry(ModelConfig(), QuantConfig()),
        cache_entry(ModelConfig(init_seed=3), QuantConfig()),
        cache_entry(ModelConfig(), QuantConfig(name=QuantMode.fp8_mxfp4)),
    }
    assert len(entries) == 3


@pytest.mark.parametrize("setting", ["", "unwritable"])
def test_without_a_usable_cache_the_model_is_built(tmp_path, monkeypatch, setting):
    if setting == "unwritable":
        blocker = tmp_path / "file"
        blocker.write_text("not a directory")
        monkeypatch.setenv(CACHE_ENV, str(blocker))  # <file>/tiny-models cannot be made
    else:
        monkeypatch.setenv(CACHE_ENV, "")  # turned off
        assert cache_entry(ModelConfig(), QuantConfig()) is None
    built = Path(materialize_model(ModelConfig(), str(tmp_path / "m")))
    assert (built / "model.safetensors").is_file()


def test_the_launcher_checks_and_copies_without_torch_or_transformers(tmp_path):
    """What `dsv4rl train` runs before it starts the processes imports neither: each would cost seconds."""
    code = (
        "import sys\n"
        "from dsv4rl.launcher import run\n"
        "from dsv4rl.model.model_dir import materialize_model, check_model_dir\n"
        "from dsv4rl.train.checkpoint_dirs import latest_checkpoint\n"
        "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
