"""The supervisor's side of `dsv4rl.faults`: where its children write their fault files, an earlier run's
files cleared, this node's live heartbeats, stack dumps on request, the children's notices for the
console, and a failed child's root cause.

Runs resume into the same run dir, so the supervisor removes its children's old heartbeats and crash
reports before it starts any (stack dumps are appended to, like logs). With several nodes sharing the run
dir, trainer ranks start only after every node's torchrun has joined, so a node never removes the files of
another node's live ranks. The watchdog reads every node's heartbeats (the trainer ranks and engines of
other nodes included: a rank here may wait on them), but signals only this node's processes.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dsv4rl.config.choices import ProcessRole
from dsv4rl.faults import engine_ports, restart_requests
from dsv4rl.faults.files import (
    CRASH,
    HEARTBEAT,
    LOG_DIR_ENV,
    NOTICE,
    PROCESS_ENV,
    STACKS,
    fault_file,
    files_of,
)
from dsv4rl.faults.heartbeat import Beat, read_beat
from dsv4rl.faults.notices import NoticeReader
from dsv4rl.faults.stacks import request_dump
from dsv4rl.launcher.plan import TRAINER_PROCESS, ProcessSpec
from dsv4rl.launcher.root_cause import RootCause, find_root_cause
from dsv4rl.launcher.watchdog import rank_of, where


@dataclass(frozen=True)
class SeenBeat:
    beat: Beat
    role: ProcessRole  # trainers are watched for progress; engines are servers
    log_dir: Path
    local: bool  # a live process of this node: it can be asked for its stacks


class ChildFaults:
    """`remote_engines`: names of engines on other nodes, whose heartbeats the watchdog reads too."""

    def __init__(self, specs: Sequence[ProcessSpec], remote_engines: Sequence[str] = ()) -> None:
        self.specs = list(specs)
        self.remote_engines = list(remote_engines)
        self._notices: dict[Path, NoticeReader] = {}

    @staticmethod
    def log_dir(spec: ProcessSpec) -> Path:
        return spec.log_path.parent

    def env(self, spec: ProcessSpec) -> dict[str, str]:
        """The child's environment: its own plus where and under which name it writes its fault files."""
        return {**spec.env, LOG_DIR_ENV: str(self.log_dir(spec)), PROCESS_ENV: spec.name}

    def clear(self) -> None:
        for spec in self.specs:
            for kind in (HEARTBEAT, CRASH, NOTICE):
                for path in files_of(self.log_dir(spec), kind, spec.name):
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
            if spec.role == ProcessRole.engine:
                restart_requests.clear(self.log_dir(spec), spec.name)
                engine_ports.clear(self.log_dir(spec), spec.name)

    def heartbeats(self, alive: set[int]) -> list[SeenBeat]:
        """Every heartbeat of this run: this node's from live processes (pids in `alive`), other nodes'."""
        owners = [(spec.name, spec.role, self.log_dir(spec)) for spec in self.specs]
        for log_dir in dict.fromkeys(self.log_dir(spec) for spec in self.specs):
            owners += [(name, ProcessRole.engine, log_dir) for name in self.remote_engines]
        host = socket.gethostname()
        found = []
        for name, role, log_dir in owners:
            for path in files_of(log_dir, HEARTBEAT, name):
                beat = read_beat(path)
                if beat is None or (beat.host == host and beat.pid not in alive):  # gone, or not ours
                    continue
                found.append(SeenBeat(beat, role, log_dir, local=beat.host == host))
        return found

    def trainer_beats(self) -> list[Beat]:
        """The training ranks' heartbeats in this node's log dirs, wherever they run: on a node that only
        serves rollouts, the trainer's node writes them into the shared run dir (none without one)."""
        found = []
        for log_dir in dict.fromkeys(self.log_dir(spec) for spec in self.specs):
            beats = (read_beat(path) for path in files_of(log_dir, HEARTBEAT, TRAINER_PROCESS))
            found += [beat for beat in beats if beat is not None]
        return found

    def dump_stacks(self, seen: Sequence[SeenBeat], reason: str, wait_s: float = 3.0) -> dict[Path, bool]:
        """Ask this node's processes in `seen` for their Python stacks: stacks file -> whether a dump came."""
        sizes: dict[Path, int] = {}
        for item in (item for item in seen if item.local):
            path = fault_file(item.log_dir, STACKS, item.beat.process)
            size = request_dump(item.beat.pid, path, reason)
            if size is not None:
                sizes[path] = size
        waiting = dict(sizes)
        deadline = time.monotonic() + wait_s
        while waiting and time.monotonic() < deadline:
            time.sleep(0.05)
            waiting = {path: size for path, size in waiting.items() if _size(path) <= size}
        time.sleep(0.1)  # a dump that has begun is written in one go by the signal handler
        return {path: path not in waiting for path in sorted(sizes)}

    def new_notices(self) -> list[str]:
        """`process: message` for each notice this node's children wrote since the last call."""
        lines = []
        for spec in self.specs:
            for path in files_of(self.log_dir(spec), NOTICE, spec.name):
                reader = self._notices.setdefault(path, NoticeReader(path))
                lines += [f"{r.get('process', spec.name)}: {r['message']}" for r in reader.read_new()]
        return lines

    def root_cause(self, spec: ProcessSpec, log_text: str) -> RootCause | None:
        return find_root_cause(self.log_dir(spec), spec.name, log_text)

    def during(self, spec: ProcessSpec, pid: int) -> str:
        """Where a server child (`spec`, pid `pid`) was when it died, by its last heartbeat, and where
        trainer rank 0 was: `" during weight_update at step 2; trainer-rank0 was in sync at step 2"`. Empty
        when its heartbeat does not say (SGLang engines write none)."""
        own = [b for b in self._beats(spec) if b.pid == pid and b.host == socket.gethostname()]
        if not own:
            return ""
        text = f" during {where(own[0])}" if own[0].busy else f" ({own[0].phase})"
        trainers = [
            b for other in self.specs if other.role == ProcessRole.trainer for b in self._beats(other)
        ]
        if trainers:
            first = min(trainers, key=lambda b: rank_of(b.process))
            text += f"; {first.process} was in {where(first)}"
        return text

    def _beats(self, spec: ProcessSpec) -> list[Beat]:
        paths = files_of(self.log_dir(spec), HEARTBEAT, spec.name)
        return [beat for path in paths if (beat := read_beat(path)) is not None]


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
