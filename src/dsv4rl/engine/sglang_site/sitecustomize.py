"""Loaded at start-up by every SGLang process dsv4rl launches (the planner puts this folder on PYTHONPATH).

SGLang 0.5.23 creates the weight-update process group with `init_custom_process_group(...)` and no
timeout, so its ranks wait torch's default (30 min) in a broken collective while the trainer gives up
after `sync.timeout_s`. There is no flag or request field for it; this hook gives that function the
trainer's timeout (from $DSV4RL_WEIGHT_SYNC_TIMEOUT_S) as its default, when `sglang.srt.utils.common` is
imported, before anything copies the name. Nothing else of SGLang or torch is touched.

It runs inside SGLang's own environment: standard library only, no dsv4rl imports. A sitecustomize
further down sys.path (an image's own) still runs.
"""

from __future__ import annotations

import datetime
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

TIMEOUT_ENV = "DSV4RL_WEIGHT_SYNC_TIMEOUT_S"
TARGET = "sglang.srt.utils.common"


def _with_timeout(function, timeout: datetime.timedelta):
    @functools.wraps(function)
    def init_custom_process_group(*args, **kwargs):
        if kwargs.get("timeout") is None and len(args) < 3:  # (backend, init_method, timeout, ...)
            kwargs["timeout"] = timeout
        return function(*args, **kwargs)

    init_custom_process_group.dsv4rl_timeout = timeout
    return init_custom_process_group


class _PatchOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds TARGET with the normal finders, runs it, then wraps its init_custom_process_group."""

    def __init__(self, timeout: datetime.timedelta):
        self.timeout = timeout
        self.spec = None

    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET or self.spec is not None:
            return None
        self.spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if self.spec is None:
            return None
        self.inner = self.spec.loader
        self.spec.loader = self
        return self.spec

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        function = getattr(module, "init_custom_process_group", None)
        if function is not None:
            module.init_custom_process_group = _with_timeout(function, self.timeout)


def _install() -> None:
    value = os.environ.get(TIMEOUT_ENV)
    if not value:
        return
    try:
        seconds = float(value)
    except ValueError:
        print(f"dsv4rl sitecustomize: ignoring {TIMEOUT_ENV}={value!r} (not a number)", file=sys.stderr)
        return
    sys.meta_path.insert(0, _PatchOnImport(datetime.timedelta(seconds=seconds)))


def _chain() -> None:
    """Run the next sitecustomize on sys.path, which this module shadows."""
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_install()
_chain()
