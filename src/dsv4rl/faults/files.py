"""Where a process's fault files live and how they are named, written and read.

The supervisor tells each child its log directory and name through the environment; a trainer rank adds
its rank (`trainer-rank3`), so every process of a run has files of its own. Files are replaced atomically
(written aside, then renamed): a reader never sees half a file.

A rename alone is atomic for readers but not across a crash of the machine: ext4 and XFS may commit the
rename before the file's data, leaving an empty or partial file under the final name after a power loss
or a kernel panic. `write_text_atomic` and `write_json_atomic` (`durable=True`) fsync the file before the
rename and the directory after it, so the name points at complete data once they return; `fsync_tree`
does the same for every file of a directory about to be renamed (a checkpoint).
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
NOTICE = "notice"  # lines for the supervisor's console (`dsv4rl.faults.notices`)
_SUFFIX = {HEARTBEAT: ".json", CRASH: ".json", STACKS: ".txt", NOTICE: ".jsonl"}


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


def fsync_dir(path: Path | str) -> None:
    """Make the entries of directory `path` (a rename, a new file) durable. A filesystem that cannot
    fsync a directory (some network filesystems refuse with EINVAL) is left as it is."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path | str) -> None:
    with open(path, "rb") as stream:  # noqa: PTH123 - a read-only descriptor is enough for fsync
        os.fsync(stream.fileno())


def fsync_tree(root: Path | str) -> None:
    """fsync every file under `root`, then every directory, deepest first (`root` last)."""
    directories = []
    for folder, _, files in os.walk(root):
        directories.append(folder)
        for name in files:
            fsync_file(Path(folder) / name)
    for folder in reversed(directories):
        fsync_dir(folder)


def write_text_atomic(path: Path, text: str, *, durable: bool = True) -> None:
    """Write `text` aside and rename it over `path`; `durable`: the data fsynced before the rename, the
    directory after it (the module docstring says why)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("w") as stream:
            stream.write(text)
            if durable:
                stream.flush()
                os.fsync(stream.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if durable:
        fsync_dir(path.parent)


def write_json_atomic(path: Path, data: dict[str, Any], *, durable: bool = True) -> None:
    """`data` as one JSON line, replacing `path` atomically. `durable=False` skips the fsyncs, for files
    that only matter while their writer lives (heartbeats, rewritten every phase or second)."""
    write_text_atomic(path, json.dumps(data) + "\n", durable=durable)


def read_json(path: Path) -> dict[str, Any] | None:
    """The object in `path`; None when it is gone or not a JSON object."""
    with contextlib.suppress(OSError, ValueError):
        data = json.loads(Path(path).read_text())
        if isinstance(data, dict):
            return data
    return None
