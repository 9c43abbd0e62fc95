"""The supervisor's table of who runs: the children it started (each in its own session, its log in
`<run_dir>/logs/<name>.log`), every descendant they spawn (`Tracker`), and the wait for the engines'
/health_generate. The supervisor decides when to start and stop; this module does it and answers who is
still there."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from rich.text import Text

from dsv4rl.config.choices import ProcessRole
from dsv4rl.engine_client.client import EngineClient
from dsv4rl.faults.heartbeat import START
from dsv4rl.faults.proc_tree import kill_group
from dsv4rl.launcher.child_faults import ChildFaults
from dsv4rl.launcher.plan import ProcessSpec
from dsv4rl.launcher.procs import Tracker, child_preexec

Say = Callable[..., None]  # the supervisor's print: above its live display when there is one


@dataclass
class Child:
    spec: ProcessSpec
    proc: subprocess.Popen
    log_start: int = 0  # logs are appended to: this run's part starts here

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass
class HealthTarget:
    """An engine to wait for: one of ours (`child`), or one on another node (`child` None)."""

    name: str
    url: str  # .../health_generate
    child: Child | None = None


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            return f"was killed by signal {-code} (exit code {code})"
    return f"exited with code {code}"


def log_tail(path: Path, lines: int = 20, start: int = 0) -> list[str]:
    """The last `lines` lines of `path` after byte `start`."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(start, f.tell() - 64 * 1024))
            data = f.read().decode(errors="replace")
    except FileNotFoundError:
        return []
    return data.splitlines()[-lines:]


class ProcessTable:
    """The children started so far and their descendants; `faults` gives each child its environment
    (heartbeat, crash report and stack-dump files) and reads them back."""

    def __init__(self, faults: ChildFaults, say: Say):
        self.faults = faults
        self.children: list[Child] = []
        self.tracker = Tracker()
        self._say = say

    def start(self, spec: ProcessSpec) -> Child:
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        with spec.log_path.open("ab") as log:
            log_start = log.tell()
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            command = subprocess.list2cmdline(spec.argv)
            log.write(f"# dsv4rl: {stamp} starting {spec.name}: {command}\n".encode())
            log.flush()
            proc = subprocess.Popen(
                spec.argv,
                env=self.faults.env(spec),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: signals reach its whole group, Ctrl-C does not
                # torchrun ignores SIGTERM (dsv4rl.train.torchrun): it learns of our death by SIGINT
                preexec_fn=child_preexec(
                    signal.SIGINT if spec.role == ProcessRole.trainer else signal.SIGTERM
                ),
            )
        self.tracker.add_leader(proc.pid)
        child = Child(spec, proc, log_start)
        self.children.append(child)
        self._say(Text(f"started {spec.name} (pid {proc.pid}), log {spec.log_path}", style="dim"))
        return child

    def restart(self, child: Child, spec: ProcessSpec | None = None) -> Child:
        """Start `child`'s spec again (same command, ports, environment; its log appended to), or `spec`
        (the same on another port), in its place; whatever is left of its process group is killed first."""
        kill_group(child.proc.pid)
        fresh = self.start(spec or child.spec)
        self.children.remove(child)
        return fresh

    def engines(self) -> list[Child]:
        return [c for c in self.children if c.spec.role == ProcessRole.engine]

    def trainers(self) -> list[Child]:
        return [c for c in self.children if c.spec.role == ProcessRole.trainer]

    def running(self) -> list[str]:
        return [c.name for c in self.children if c.proc.poll() is None]

    def any_alive(self) -> bool:
        for child in self.children:
            child.proc.poll()
        self.tracker.reap()
        table = self.tracker.refresh()
        return any(c.proc.returncode is None for c in self.children) or bool(self.tracker.alive(table))

    def trainer_failed(self) -> bool:
        return any(c.proc.poll() not in (None, 0) for c in self.trainers())

    def trainer_past_its_engine_wait(self) -> bool:
        """Whether a trainer of this node left its start phase: it waits for the engines itself, so they
        answered it, and the supervisor's own probes would only compete with its requests."""
        seen = self.faults.heartbeats(set(self.tracker.alive(self.tracker.refresh())))
        return any(item.role == ProcessRole.trainer and item.beat.phase != START for item in seen)


def wait_healthy(
    engines: list[HealthTarget],
    timeout_s: float,
    should_abort: Callable[[HealthTarget], bool],
    trainer_past_its_wait: Callable[[], bool],
    say: Say,
) -> tuple[HealthTarget, str] | None:
    """None when every engine answers /health_generate within `timeout_s`; else (engine, reason).
    `should_abort(engine)` ends the wait for it; a trainer past its own wait for the engines ends every
    probe (they answered it)."""
    trainer_saw_them = []

    def answered_elsewhere() -> bool:
        if not trainer_saw_them and trainer_past_its_wait():
            trainer_saw_them.append(True)
        return bool(trainer_saw_them)

    async def one(target: HealthTarget) -> None:
        parts = urlsplit(target.url)
        client = EngineClient(f"{parts.scheme}://{parts.netloc}", retries=0)
        try:
            await client.wait_healthy(
                timeout_s, lambda: should_abort(target), answered_elsewhere=answered_elsewhere
            )
        finally:
            await client.aclose()

    async def all_of() -> tuple[HealthTarget, str] | None:
        tasks = {asyncio.create_task(one(t)): t for t in engines}
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in pending:
            task.cancel()
        for task in done:
            if task.exception() is not None:
                return tasks[task], str(task.exception())
        return None

    if not engines:
        return None
    remote = sum(t.child is None for t in engines)
    where = f" ({remote} on other nodes)" if remote else ""
    say(Text(f"waiting for {len(engines)} engine(s){where} to answer /health_generate ...", style="dim"))
    start = time.monotonic()
    failure = asyncio.run(all_of())
    if failure is None and trainer_saw_them:
        say(Text(f"the trainer is past its wait for the engines ({time.monotonic() - start:.1f} s)"))
    elif failure is None:
        say(Text(f"engines healthy after {time.monotonic() - start:.1f} s", style="green"))
    return failure
