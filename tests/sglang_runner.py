"""Runs test code inside SGLang 0.5.23's own interpreter: the `sglang` test group (`pytest -m sglang`).

SGLang lives in an environment of its own (`make install-sglang` makes `.venv-sglang`; or
`$DSV4RL_SGLANG_PYTHON`): it pins torch 2.14.1 and transformers 5.19, the trainer needs 5.23. A test of this
group writes what dsv4rl produced (a model directory, a launch command, request bodies, the buckets of a
push as safetensors files), asks SGLang's side (`tests/sglang_side/`) to read it with SGLang's own code, and
compares what comes back with what dsv4rl meant.

Without the interpreter the group skips, naming the command that makes it; with `DSV4RL_REQUIRE_SGLANG=1`
(CI sets it) a missing interpreter fails the run instead, so CI never passes by skipping them.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SIDE = Path(__file__).resolve().parent / "sglang_side"
PYTHON_ENV = "DSV4RL_SGLANG_PYTHON"
REQUIRE_ENV = "DSV4RL_REQUIRE_SGLANG"
VERSION = "0.5.23"

SGLANG_PYTHON = Path(os.environ.get(PYTHON_ENV) or ROOT / ".venv-sglang" / "bin" / "python")
_why = (
    f"no SGLang interpreter at {SGLANG_PYTHON}: run `make install-sglang` (or set ${PYTHON_ENV} to the "
    f"python of an environment with sglang=={VERSION}), then `pytest -m sglang`"
)
if not SGLANG_PYTHON.exists() and os.environ.get(REQUIRE_ENV) == "1":
    raise RuntimeError(f"{REQUIRE_ENV}=1 but {_why}")

# Every test of the group carries both: `pytest -m sglang` selects exactly them.
needs_sglang = [pytest.mark.sglang, pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason=_why)]

# CPU only, whatever the machine has: SGLang's code is checked here, not its kernels.
BASE_ENV = {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"}


class SGLangError(AssertionError):
    """SGLang's side raised: the message is its traceback (SGLang's own error, file and line)."""


class SGLangSide:
    """One worker process in SGLang's interpreter, with the environment variables it was started with
    (SGLang reads some at import, e.g. `SGLANG_OPT_FP8_WO_A_GEMM`, so a worker serves one environment)."""

    def __init__(self, env: Mapping[str, str], log_dir: Path) -> None:
        self.env = dict(env)
        self.log_path = log_dir / f"sglang-side-{os.getpid()}-{secrets.token_hex(3)}.log"
        authkey = secrets.token_bytes(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=authkey)
        host, port = self._listener.address
        self._log = self.log_path.open("w")
        self._proc = subprocess.Popen(
            [str(SGLANG_PYTHON), str(SIDE / "worker.py"), host, str(port)],
            stdin=subprocess.PIPE, stdout=self._log, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, **BASE_ENV, **self.env}, cwd=str(SIDE),
        )  # fmt: skip
        assert self._proc.stdin is not None
        self._proc.stdin.write(authkey.hex() + "\n")
        self._proc.stdin.close()
        self._conn = None
        self._closed = False
        self._conn = self._accept(timeout_s=300)
        hello = self._receive(timeout_s=300)
        self.version = hello["ready"]
        if self.version != VERSION:
            raise RuntimeError(f"{SGLANG_PYTHON} has sglang {self.version}; these tests are for {VERSION}")

    def _check(self, deadline: float, waiting_for: str) -> None:
        """Raise, with the worker's log, when it died or `deadline` passed while waiting."""
        if self._proc.poll() is not None:
            raise RuntimeError(f"SGLang's interpreter exited ({self._proc.returncode}): {self.log_tail()}")
        if time.monotonic() > deadline:
            self.close()
            raise TimeoutError(f"no {waiting_for} from SGLang's interpreter in time: {self.log_tail()}")

    def _accept(self, timeout_s: float):
        accepted: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: accepted.update(conn=self._listener.accept()), daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout_s
        while True:
            thread.join(1.0)
            if not thread.is_alive():
                return accepted["conn"]
            self._check(deadline, "connection")

    def _receive(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(1.0):
            self._check(deadline, "answer")
        return self._conn.recv()

    def alive(self) -> bool:
        return self._proc.poll() is None

    def call(self, target: str, timeout_s: float = 600, **kwargs: Any) -> Any:
        """`module:function` of `tests/sglang_side/` with plain-data keyword arguments; its result."""
        self._conn.send({"call": target, "kwargs": kwargs})
        answer = self._receive(timeout_s)
        if "error" in answer:
            raise SGLangError(f"{target} raised in SGLang's interpreter:\n{answer['error']}")
        return answer["ok"]

    def log_tail(self, chars: int = 4000) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._conn is not None and self.alive():
            try:
                self._conn.send(None)
                self._proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.alive():
            self._proc.kill()
            self._proc.wait()
        self._listener.close()
        self._log.close()


class SGLangSides:
    """The session's workers, one per environment, started on first use and closed at the end."""

    def __init__(self) -> None:
        self._sides: dict[tuple[tuple[str, str], ...], SGLangSide] = {}
        self._log_dir = Path(tempfile.mkdtemp(prefix="dsv4rl-sglang-side-"))

    def get(self, env: Mapping[str, str] | None = None) -> SGLangSide:
        key = tuple(sorted((env or {}).items()))
        side = self._sides.get(key)
        if side is None or not side.alive():
            side = self._sides[key] = SGLangSide(dict(key), self._log_dir)
        return side

    def close(self) -> None:
        for side in self._sides.values():
            side.close()
        self._sides.clear()
        shutil.rmtree(self._log_dir, ignore_errors=True)
