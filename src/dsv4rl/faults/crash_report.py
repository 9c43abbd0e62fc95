"""Crash reports: the exception that ended a process, where the supervisor can find it.

A child's log ends with whatever its launcher printed last (torchrun's ChildFailedError block, uvicorn's
shutdown lines), far below the traceback that matters. `crash_report` writes `crash-<process>.json`
(type, message, the frame it was raised in, the traceback) when an exception leaves the entry point.
A `SystemExit` with an exit code is a deliberate exit that printed its own reason, and Ctrl-C is no
crash: neither writes a report; `sys.exit("message")` does.
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from dsv4rl.faults.files import read_json, write_json_atomic

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # .../dsv4rl
FAULTS_DIR = Path(__file__).resolve().parent  # its own frames (the context managers) explain nothing
MAX_TRACEBACK_CHARS = 20_000


@dataclass(frozen=True)
class CrashReport:
    process: str
    pid: int
    time: float
    type: str  # ValueError, torch.distributed.DistBackendError, ...
    message: str
    frame: str  # where it was raised: "src/dsv4rl/train/loop.py:123 in step"
    project_frame: str | None  # the innermost dsv4rl frame, when the raise happened outside dsv4rl
    traceback: str

    def headline(self) -> str:
        """`ValueError: bad value (at src/dsv4rl/x.py:3 in f)`, the message's first line only."""
        lines = self.message.strip().splitlines()
        message = lines[0] + (" ..." if len(lines) > 1 else "") if lines else ""
        where = self.frame + (f", called from {self.project_frame}" if self.project_frame else "")
        return f"{self.type}: {message} (at {where})" if message else f"{self.type} (at {where})"

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CrashReport | None:
        try:
            return cls(**{name: data[name] for name in cls.__dataclass_fields__})
        except (KeyError, TypeError):
            return None


def short_path(filename: str) -> str:
    """Relative to the working directory when under it (`src/dsv4rl/...`), else as it is."""
    try:
        return os.path.relpath(filename) if Path(filename).resolve().is_relative_to(Path.cwd()) else filename
    except (OSError, ValueError):
        return filename


def _describe(frame: traceback.FrameSummary) -> str:
    return f"{short_path(frame.filename)}:{frame.lineno} in {frame.name}"


def _in_package(frame: traceback.FrameSummary) -> bool:
    try:
        path = Path(frame.filename).resolve()
    except (OSError, ValueError):
        return False
    return path.is_relative_to(PACKAGE_DIR) and not path.is_relative_to(FAULTS_DIR)


def exception_type(error: BaseException) -> str:
    kind = type(error)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _without_own_frames(tb: TracebackType | None) -> TracebackType | None:
    """The traceback from below the context managers of this package that carried the error out."""
    while tb is not None and Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(FAULTS_DIR):
        tb = tb.tb_next
    return tb


def build_report(error: BaseException, process: str) -> CrashReport:
    tb = _without_own_frames(error.__traceback__)
    frames = traceback.extract_tb(tb)
    frame = _describe(frames[-1]) if frames else "<unknown>"
    project = None
    if frames and not _in_package(frames[-1]):
        ours = [f for f in frames if _in_package(f)]
        project = _describe(ours[-1]) if ours else None
    text = "".join(traceback.format_exception(type(error), error, tb))
    return CrashReport(
        process=process,
        pid=os.getpid(),
        time=time.time(),
        type=exception_type(error),
        message=str(error),
        frame=frame,
        project_frame=project,
        traceback=text[-MAX_TRACEBACK_CHARS:],
    )


def is_crash(error: BaseException) -> bool:
    if isinstance(error, KeyboardInterrupt):
        return False
    if isinstance(error, SystemExit):
        return not (error.code is None or isinstance(error.code, int))
    return True


@contextmanager
def crash_report(path: Path, process: str) -> Iterator[None]:
    """Write `path` when an exception (a crash, see `is_crash`) leaves the block; re-raise it."""
    try:
        yield
    except BaseException as error:
        if is_crash(error):
            with contextlib.suppress(OSError):  # the original error matters more than its report
                write_json_atomic(Path(path), asdict(build_report(error, process)))
        raise


def read_crash_report(path: Path) -> CrashReport | None:
    data = read_json(path)
    return None if data is None else CrashReport.from_json(data)
