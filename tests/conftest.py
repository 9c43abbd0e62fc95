"""Session-wide settings: one tiny-model cache for the whole session, not the user's ~/.cache.

The end-to-end runs start `dsv4rl` as subprocesses; they inherit the variable, so after the first build
every run copies the model instead of importing transformers to build it (dsv4rl.model.model_dir)."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from dsv4rl.model.model_dir import CACHE_ENV

_made: list[str] = []


def pytest_configure(config) -> None:
    if CACHE_ENV not in os.environ:
        _made.append(tempfile.mkdtemp(prefix="dsv4rl-test-cache-"))
        os.environ[CACHE_ENV] = _made[0]


def pytest_unconfigure(config) -> None:
    for path in _made:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def sglang_sides():
    """SGLang 0.5.23's interpreter for the `sglang` group (tests/sglang_runner.py): `sglang_sides.get(env)`
    is a worker started with those environment variables, shared by the session."""
    from sglang_runner import SGLangSides

    sides = SGLangSides()
    yield sides
    sides.close()
