"""The SGLang side of the `sglang` test group: a long-lived process in SGLang's own interpreter.

Started by `tests/sglang_runner.py` as `<sglang python> worker.py HOST PORT` with the auth key on stdin; it
connects back, then runs calls `{"call": "module:function", "kwargs": {...}}` on the modules of this folder
and answers `{"ok": result}` or `{"error": traceback}`. Results are plain data (dicts, lists, numbers,
strings, bytes): the two interpreters run different torch and transformers releases, so no object of
either crosses; tensors travel as safetensors files. One process serves a whole pytest session because
importing SGLang's model code costs 10-20 s; the patches it needs on CPU (`cpu_patches.py`) are installed
once, by the first call that builds a model.

Imports nothing of dsv4rl: it must run where only SGLang is installed.
"""

from __future__ import annotations

import importlib
import sys
import traceback
from multiprocessing.connection import Client
from pathlib import Path


def main() -> None:
    host, port = sys.argv[1], int(sys.argv[2])
    authkey = bytes.fromhex(sys.stdin.readline().strip())
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    with Client((host, port), authkey=authkey) as conn:
        import sglang

        conn.send({"ready": sglang.__version__, "python": sys.executable})
        while True:
            try:
                request = conn.recv()
            except EOFError:
                return
            if request is None:
                return
            try:
                module_name, _, function = request["call"].partition(":")
                result = getattr(importlib.import_module(module_name), function)(**request["kwargs"])
                conn.send({"ok": result})
            except BaseException:  # noqa: BLE001 - every failure goes back to the test that asked
                conn.send({"error": traceback.format_exc()})


if __name__ == "__main__":
    main()
