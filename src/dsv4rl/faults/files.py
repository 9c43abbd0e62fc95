"""Where a process's fault files live and how they are named, written and read.

The supervisor tells each child its log directory and name through the environment; a trainer rank adds
its rank (`trainer-rank3`), so every process of a run has files of its own. Files are replaced atomically
(written aside, then renamed): a reader never sees half a file.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

LOG_DIR_ENV = "DSV4RL_LOG_DIR"  # the run's logs/ directory, set by the supervisor
PROCESS_ENV = "DSV4RL_PROCESS_NAME"  # the child's name in the plan: "engine-0", "trainer"

HEARTBEAT = "heartbeat"
CRASH = "crash"
STACKS = "stacks"
_SUFFIX = {HEARTBEAT: ".json", CRASH: ".json", STACKS: ".txt"}


def fault_file(log_dir: Path | str, kind: str, process: str) -> Path:
    """`<log_dir>/<kind>-<process>.json` (`.txt` for stacks)."""
    return Path(log_dir) / f"{kind}-{process}{_SUFFIX[kind]}"


def process_of(path: Path, kind: str) -> str | None:
    """The process a fault file belongs to (`heartbeat-trainer-rank0.json` -> `trainer-rank0`)."""
    prefix, suffix = f"{kind}-", _SUFFIX[kind]
    name = path.name
    if not (name.startswith(prefix) and name.endswith(suffix)):
        return None
    return name[len(prefix) : -len(suffix)] or None


def owned_by(process: str, child: str) -> bool:
    """Whether `process` is the supervisor's child `child` or one of its ranks (`trainer-rank1`)."""
    return process == child or process.startswith(f"{child}-rank")


def files_of(log_dir: Path | str, kind: str, child: str) -> list[Path]:
    """The `kind` files of `child` and its ranks in `log_dir`."""
    found = []
    for path in sorted(Path(log_dir).glob(f"{kind}-{child}*{_SUFFIX[kind]}")):
        process = process_of(path, kind)
        if process is not None and owned_by(process, child):
            found.append(path)
    return found


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data) + "\n")
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    """The object in `path`; None when it is gone or not a JSON object."""
    with contextlib.suppress(OSError, ValueError):
        data = json.loads(Path(path).read_text())
        if isinstance(data, dict):
            return data
    return None
