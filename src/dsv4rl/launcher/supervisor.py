"""The node supervisor: start the plan's processes, wait for the engines, watch, and tear everything down.

Rules: the trainer starts with this node's engines and waits for them itself (their start-ups overlap),
while the supervisor waits for their /health_generate too, to name an engine that dies or never answers;
engines on other nodes must answer before the trainer starts. The run succeeds when every trainer exits 0;
any other exit (a crash, a kill, an engine quitting early) stops every child and shows the failing child's
root cause (its exception, or the rank and signal torchrun saw) or else its log tail; Ctrl-C stops every
child and returns 130. In a training run (`stop_grace_s` > 0) the first SIGTERM or SIGUSR1 is a graceful
stop: the trainer is asked to stop at its next step boundary (`<run_dir>/STOP`, `dsv4rl.faults.stop`),
checkpoints and exits, and the run returns STOPPED_EXIT (75) with the command that resumes it; a second
signal, or `stop_grace_s` without the trainer gone, stops every child at once (130).
Children run in their own sessions with logs in `<run_dir>/logs/<name>.log`; descendants are tracked so
none outlives the run. Hang watchdog: a trainer phase without progress for `step_timeout_s` makes every
child dump its Python stacks (`logs/stacks-<process>.txt`), then the run stops naming the phase and the
process that did not advance (`dsv4rl.launcher.watchdog`); the children's side is `dsv4rl.faults`.

Multi-node: node 0 writes `<run_dir>/DONE` when its trainer exits (`dsv4rl.launcher.marker`); a node that
only runs engines serves until that marker appears, then stops its engines and exits 0 (1 if the marker
says the run failed, or if one of its engines dies first). Every node keeps a heartbeat in the run dir and
stops, naming the node, when one it depends on stops, goes silent or never comes up
(`dsv4rl.launcher.node_liveness`).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from rich.console import Console
from rich.live import Live
from rich.panel import Panel
from rich.text import Text

from dsv4rl.config.schema import ProcessRole
from dsv4rl.engine_client.client import EngineClient
from dsv4rl.faults.failed_push import FAILED_PUSH_EXIT, FailedPushRecord
from dsv4rl.faults.heartbeat import START
from dsv4rl.faults.proc_tree import become_subreaper
from dsv4rl.faults.stop import STOP_SIGNALS, STOPPED_EXIT, StoppedRecord, request_stop
from dsv4rl.launcher.child_faults import ChildFaults
from dsv4rl.launcher.marker import FINISHED, DoneMarker
from dsv4rl.launcher.node_liveness import NodeLiveness
from dsv4rl.launcher.plan import METRICS_FILE, ProcessSpec
from dsv4rl.launcher.procs import Tracker, child_preexec
from dsv4rl.launcher.progress import MetricsTail, RunProgress
from dsv4rl.launcher.reachability import unreachable_engines
from dsv4rl.launcher.watchdog import Hang, describe, find_hang

INTERRUPTED = 130
STOPPED = "stopped"  # the DONE marker's and the summary's status of a graceful stop
FAILED_PUSH = "failed_push"  # ... of a weight push that failed on engines that must be restarted


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


class Supervisor:
    """Runs `specs` (engines, then trainers) to completion; `run()` returns the exit code.

    `remote_engines`: (name, health URL) of engines on other nodes, waited for before the trainer starts.
    `done_marker`: with trainers in `specs` (node 0 only), written when the run ends; without trainers
    (a rollout-only node), the run ends when it appears. `show_progress`: tail the metrics (one node).
    `step_timeout_s`: the hang watchdog's limit (0: off). `stop_grace_s`: how long a graceful stop may take
    (0: every signal stops at once, as for `dsv4rl eval`); `resume_hint`: the command that resumes the run.

    `run()` makes this process a child subreaper and treats every process reparented to it during the
    run as part of the run: nothing else in this process should start child processes meanwhile.
    """

    def __init__(
        self,
        specs: Sequence[ProcessSpec],
        run_dir: Path,
        *,
        total_steps: int = 0,
        console: Console | None = None,
        live: bool | None = None,
        startup_timeout_s: float = 300.0,
        grace_s: float = 10.0,
        poll_s: float = 0.25,
        tail_lines: int = 20,
        step_timeout_s: float = 0.0,
        remote_engines: Sequence[tuple[str, str]] = (),
        done_marker: DoneMarker | None = None,
        show_progress: bool = True,
        liveness: NodeLiveness | None = None,
        log_every: int = 1,
        node_addrs: Sequence[str] = (),
        stop_grace_s: float = 0.0,
        resume_hint: str = "",
    ):
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"process names must be unique, got {names}")
        self.specs = list(specs)
        self.run_dir = Path(run_dir)
        self.console = console or Console()
        self.live = self.console.is_terminal if live is None else live and self.console.is_terminal
        self.startup_timeout_s = startup_timeout_s
        self.grace_s = grace_s
        self.poll_s = poll_s
        self.tail_lines = tail_lines
        self.step_timeout_s = step_timeout_s
        # The children's heartbeats, crash reports and stack dumps (and the other nodes' engines' heartbeats).
        self.faults = ChildFaults(self.specs, [name for name, _ in remote_engines])
        self.hang: Hang | None = None
        self.remote_engines = list(remote_engines)
        self.done_marker = done_marker
        self.show_progress = show_progress
        self.liveness = liveness  # multi-node: this node's heartbeat, and the nodes it depends on
        self.node_addrs = list(node_addrs)  # cluster.node_addrs: which node a remote engine's address is
        self._lost_node: str | None = None  # why a node this one depends on is gone
        self._failure = ""  # what failed here, for the final heartbeat
        self.root_cause: str | None = None  # the failed process's own words (its crash report)
        self.status: str | None = None  # finished, stopped, failed, hung or interrupted, once run() returns
        self.children: list[Child] = []
        self.tracker = Tracker()
        self.progress = RunProgress(total_steps)
        self.log_every = max(1, log_every)  # train.log_every: one printed line every that many steps
        self._metrics = MetricsTail(self.run_dir / METRICS_FILE, only_new=True)  # never an earlier run's
        self._signals: list[int] = []
        self._display: Live | None = None
        self.stop_grace_s = stop_grace_s
        self.resume_hint = resume_hint
        self._stopping: float | None = None  # when the graceful stop began (monotonic)
        self._at_once = False  # a signal stops every process now (said once)
        self._gone_while_stopping: set[str] = set()  # children that exited during a graceful stop
        self._stopped = StoppedRecord(self.run_dir)  # trainer rank 0's record of a stop at a step boundary
        self._failed_push = FailedPushRecord(self.run_dir)  # ... of a push that spent the engines
        self._stop_message = ""

    # ----------------------------------------------------------------------------------- output
    def _print(self, *objects: object, soft_wrap: bool = False) -> None:
        (self._display.console if self._display else self.console).print(*objects, soft_wrap=soft_wrap)

    def _report_failure(self, child: Child, reason: str) -> None:
        if child.spec.role != ProcessRole.trainer and child.proc.returncode is not None:
            reason += self.faults.during(child.spec, child.proc.pid)  # an engine: in which work it died
        self._failure = f"{child.name} {reason}"
        self._print(Text(f"✗ {child.name} {reason}", style="bold red"), soft_wrap=True)
        if self._show_root_cause(child):
            return
        tail = log_tail(child.spec.log_path, self.tail_lines, child.log_start)
        body = Text("\n".join(tail) if tail else "(empty log)", style="red")
        title = f"last {len(tail)} lines of {child.spec.log_path}"
        self._print(Panel(body, title=title, border_style="red", expand=False))

    def _show_root_cause(self, child: Child) -> bool:
        """Print why `child` failed in its own words; True when its traceback stands in for the log tail."""
        log_text = "\n".join(log_tail(child.spec.log_path, 5000, child.log_start))  # torchrun's block
        cause = self.faults.root_cause(child.spec, log_text)
        if cause is None:
            return False
        self.root_cause = self.root_cause or cause.headline
        self._print(Text(f"root cause: {cause.headline}", style="bold red"), soft_wrap=True)
        for line in cause.others:
            self._print(Text(f"  also: {line}", style="red"), soft_wrap=True)
        if not cause.traceback:
            return False
        lines = cause.traceback.rstrip().splitlines()[-self.tail_lines :]
        title = f"{cause.process}'s traceback"
        self._print(Panel(Text("\n".join(lines), style="red"), title=title, border_style="red", expand=False))
        self._print(Text(f"crash report: {cause.source}", style="dim"), soft_wrap=True)
        self._print(Text(f"full log: {child.spec.log_path}", style="dim"), soft_wrap=True)
        return True

    def _hung(self, table: dict) -> bool:
        """The hang watchdog: on a trainer phase without progress for `step_timeout_s`, every child with a
        heartbeat dumps its Python stacks and the run stops."""
        if self.step_timeout_s <= 0:
            return False
        seen = self.faults.heartbeats(set(self.tracker.alive(table)))
        watched = [item.beat for item in seen if item.role == ProcessRole.trainer]
        servers = [item.beat for item in seen if item.role != ProcessRole.trainer]
        now = time.time()
        self.hang = find_hang(watched, servers, self.step_timeout_s, now)
        if self.hang is None:
            return False
        headline = self.hang.headline(self.step_timeout_s)
        self._failure = headline
        self._print(Text(f"✗ {headline}", style="bold red"), soft_wrap=True)
        dumps = self.faults.dump_stacks(seen, headline)
        lines = [describe(item.beat, now) + ("" if item.local else " (another node)") for item in seen]
        body = Text("\n".join(lines), style="red")
        self._print(Panel(body, title="every process at the hang", border_style="red", expand=False))
        for path, came in dumps.items():  # whole paths, never wrapped: they are copied into editors
            self._print(Text(f"Python stacks: {path}" + ("" if came else " (no dump came)")), soft_wrap=True)
        self._name_unreachable()
        return True

    def _name_unreachable(self) -> None:
        """Multi-node, after the trainer failed or hung: name the engines on other nodes that the network
        no longer reaches (a partition: their nodes still beat in the shared run dir)."""
        if not (self.remote_engines and self._trainer_specs()):
            return
        for line in unreachable_engines(self.remote_engines, self.node_addrs):
            self._failure = self._failure or line
            self._print(Text(f"✗ {line}", style="bold red"), soft_wrap=True)

    def _poll_notices(self) -> None:
        """Print what the children asked the console to show (`dsv4rl.faults.notices`)."""
        for line in self.faults.new_notices():
            self._print(Text(f"! {line}", style="bold yellow"), soft_wrap=True)

    def _poll_metrics(self) -> None:
        self._poll_notices()
        if not self.show_progress:
            return
        records = self._metrics.read_new()
        if self._metrics.rewritten:  # resumed: the trainer cut the file back to its checkpoint
            self.progress = RunProgress(self.progress.total_steps)
        for record in records:
            self.progress.add(record)
            if self._display is None and self._line_due(record):
                self._print(Text(self.progress.line(record)), soft_wrap=True)
        if self._display is not None:
            self._display.update(self.progress.renderable(), refresh=True)

    def _line_due(self, record: dict) -> bool:
        """Without the live display, a step prints a line every `log_every` steps, and the last one always."""
        step = record.get("step")
        if not isinstance(step, int):
            return True
        return step % self.log_every == 0 or step == self.progress.total_steps

    # ----------------------------------------------------------------------------------- processes
    def _start(self, spec: ProcessSpec) -> Child:
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
        self._print(Text(f"started {spec.name} (pid {proc.pid}), log {spec.log_path}", style="dim"))
        return child

    def _wait_healthy(self, engines: list[HealthTarget]) -> tuple[HealthTarget, str] | None:
        """None when all are healthy; else (engine, reason)."""

        def should_abort(target: HealthTarget) -> bool:
            table = self.tracker.refresh()  # remember what the engines spawn while they load
            exited = target.child is not None and target.child.proc.poll() is not None
            # A trainer started early waits for the engines itself and may be past that wait while this one
            # still polls: an engine hung in the trainer's first generate never answers either, so the
            # watchdog judges here too, or a 30 s hang would be reported as a 300 s startup failure.
            hung = self.hang is not None or self._hung(table)
            # a trainer that already failed ends the wait: the watch loop below reports it
            return (
                exited
                or hung
                or self._trainer_failed()
                or self._interrupted()
                or self._node_lost(stopped_only=True)
            )

        trainer_saw_them = []

        def trainer_past_its_wait() -> bool:
            if not trainer_saw_them and self._trainer_past_its_engine_wait():
                trainer_saw_them.append(True)
            return bool(trainer_saw_them)

        async def one(target: HealthTarget) -> None:
            parts = urlsplit(target.url)
            client = EngineClient(f"{parts.scheme}://{parts.netloc}", retries=0)
            try:
                await client.wait_healthy(
                    self.startup_timeout_s,
                    lambda: should_abort(target),
                    answered_elsewhere=trainer_past_its_wait,
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
        self._print(
            Text(f"waiting for {len(engines)} engine(s){where} to answer /health_generate ...", style="dim")
        )
        start = time.monotonic()
        failure = asyncio.run(all_of())
        if failure is None and trainer_saw_them:
            self._print(
                Text(f"the trainer is past its wait for the engines ({time.monotonic() - start:.1f} s)")
            )
        elif failure is None:
            self._print(Text(f"engines healthy after {time.monotonic() - start:.1f} s", style="green"))
        return failure

    def _trainer_past_its_engine_wait(self) -> bool:
        """Whether a trainer of this node left its start phase: it waits for the engines itself, so they
        answered it, and the supervisor's own probes would only compete with its requests."""
        seen = self.faults.heartbeats(set(self.tracker.alive(self.tracker.refresh())))
        return any(item.role == ProcessRole.trainer and item.beat.phase != START for item in seen)

    def stop_all(self) -> None:
        """SIGTERM every child's group and orphaned descendants (SIGINT to the trainer's: torchrun passes it
        on, and it ends a rank at once), wait `grace_s`, then SIGKILL the rest."""
        if self._any_alive():
            for child in self.children:
                if child.spec.role == ProcessRole.trainer and child.proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(child.proc.pid, signal.SIGINT)
            self.tracker.signal_groups(signal.SIGTERM)
            deadline = time.monotonic() + self.grace_s
            # A signal during the polite wait (a second Ctrl-C) ends it.
            signals = len(self._signals)
            while self._any_alive() and time.monotonic() < deadline and len(self._signals) == signals:
                self.tracker.signal_orphans(signal.SIGTERM)  # descendants whose parent died meanwhile
                time.sleep(0.05)
        if self._any_alive():
            self.tracker.kill_all()
            deadline = time.monotonic() + 5.0
            while self._any_alive() and time.monotonic() < deadline:
                time.sleep(0.05)

    def _any_alive(self) -> bool:
        for child in self.children:
            child.proc.poll()
        self.tracker.reap()
        table = self.tracker.refresh()
        return any(c.proc.returncode is None for c in self.children) or bool(self.tracker.alive(table))

    # ----------------------------------------------------------------------------------- main loop
    def _on_signal(self, signum: int, frame: object) -> None:
        self._signals.append(signum)

    def run(self) -> int:
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, *STOP_SIGNALS):
                handlers[sig] = signal.signal(sig, self._on_signal)
        atexit.register(self._atexit)
        become_subreaper()
        status = "failed"
        try:
            code = self._run()
            statuses = {
                0: "finished",
                INTERRUPTED: "interrupted",
                STOPPED_EXIT: STOPPED,
                FAILED_PUSH_EXIT: FAILED_PUSH,
            }
            status = "hung" if self.hang else statuses.get(code, "failed")
            return code
        except KeyboardInterrupt:
            status = "interrupted"
            return INTERRUPTED
        finally:
            self.status = status
            if self._display is not None:
                self._display.stop()
                self._display = None
            running = [c.name for c in self.children if c.proc.poll() is None]
            if running:
                self._print(Text(f"stopping {', '.join(running)} ...", style="dim"))
            self.stop_all()
            atexit.unregister(self._atexit)
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            if self.done_marker is not None and self._trainer_specs():
                with contextlib.suppress(OSError):
                    self.done_marker.write(status)
                    self._print(Text(f"wrote {self.done_marker.path} ({status})", style="dim"))
            if self.liveness is not None:  # after DONE: a peer that sees this node stopped finds the marker
                self.liveness.stop(status, self._failure)
            self._poll_metrics()
            style = {"finished": "bold green", "interrupted": "bold yellow", STOPPED: "bold yellow"}
            style = style.get(status, "bold red")
            if self.show_progress:
                summary = self.progress.summary(self.run_dir, status)
                self.console.print(Panel(summary, border_style=style, expand=False))
            else:
                self.console.print(Text(f"{status} (run dir {self.run_dir})", style=style))
            if self._stop_message:
                self.console.print(Text(self._stop_message, style="bold yellow"), soft_wrap=True)

    @property
    def failure(self) -> str | None:
        """Why the run did not finish, in one line (the root cause when a crash report gave one)."""
        return self.root_cause or self._failure or None

    def _interrupted(self) -> bool:
        """Whether a signal stops every process now. In a training run the first SIGTERM or SIGUSR1 starts a
        graceful stop instead (`_begin_stop`); then a second signal, or `stop_grace_s` gone by, stops all."""
        if self._at_once or not self._signals:
            return self._at_once
        first = signal.Signals(self._signals[0]).name
        if self._stopping is None and not self._begin_stop(self._signals[0]):
            why = f"{first} received: stopping every process"
        elif len(self._signals) > 1:
            second = signal.Signals(self._signals[1]).name
            why = f"{second} received during the graceful stop: stopping every process now"
        elif time.monotonic() - self._stopping > self.stop_grace_s:
            why = (
                f"the trainer did not stop within run.stop_grace_s={self.stop_grace_s:g} s: stopping every "
                "process now"
            )
        else:
            return False
        self._at_once = True
        self._print(Text(why, style="bold yellow"), soft_wrap=True)
        return True

    def _begin_stop(self, signum: int) -> bool:
        """A graceful stop when it can be one: ask the trainer (`<run_dir>/STOP`, read by trainer rank 0 at
        each step boundary) and keep watching. Not before the trainer has left its start (nothing to save)."""
        if signum not in STOP_SIGNALS or self.stop_grace_s <= 0:
            return False
        trainers_here = bool(self._trainer_specs())
        if trainers_here and not self._trainer_past_its_engine_wait():
            return False
        name = signal.Signals(signum).name
        try:
            path = request_stop(self.run_dir, f"{name} to the supervisor (pid {os.getpid()})")
        except OSError as error:
            self._print(Text(f"{name} received; the stop request cannot be written ({error})", style="red"))
            return False
        self._stopping = time.monotonic()
        if trainers_here:
            text = (
                f"{name} received: the trainer ends its step, writes a checkpoint and exits ({path}; at most "
                f"run.stop_grace_s={self.stop_grace_s:g} s, a second signal stops every process at once)"
            )
        else:
            text = (
                f"{name} received: the trainer (node 0) stops at its next step boundary ({path}); this node "
                "serves until then (a second signal stops it at once)"
            )
        self._print(Text(text, style="bold yellow"), soft_wrap=True)
        return True

    def _unless_stopping(self, failed: list[tuple[Child, int]]) -> list[tuple[Child, int]]:
        """During a graceful stop only a trainer's exit counts: engines may go first (Slurm signals every
        process of a job), while the trainer still writes its checkpoint."""
        if self._stopping is None:
            return failed
        for child, code in failed:
            if child.spec.role != ProcessRole.trainer and child.name not in self._gone_while_stopping:
                self._gone_while_stopping.add(child.name)
                self._print(Text(f"{child.name} {describe_exit(code)} while the run stops", style="dim"))
        return [(child, code) for child, code in failed if child.spec.role == ProcessRole.trainer]

    def _trainers_done(self) -> int:
        """Every trainer exited 0: the run finished, or it stopped at a step boundary (STOPPED_EXIT)."""
        record = self._stopped.read()
        if record is None:
            return 0
        step, checkpoint = record.get("step"), record.get("checkpoint")
        saved = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint yet: a resumed run starts over"
        how = self.resume_hint or "the same command with resume=auto"
        self._stop_message = f"stopped after step {step} ({saved}); continue with: {how}"
        return STOPPED_EXIT

    def _after_failed_push(self) -> bool:
        """The trainer failed after recording a weight push that spent the engines (`<run_dir>/FAILED_PUSH`):
        say so; the run then ends with FAILED_PUSH_EXIT (fresh engines and resume=auto carry on)."""
        record = self._failed_push.read()
        if record is None:
            return False
        self._print(
            Text(
                f"the weight push of step {record.get('step')} failed on engines whose weight "
                f"post-processing is not idempotent ({self._failed_push.path}): they cannot take another "
                "push, so the run ends; fresh engines and resume=auto continue it",
                style="bold red",
            ),
            soft_wrap=True,
        )
        return True

    def _trainer_specs(self) -> list[ProcessSpec]:
        return [s for s in self.specs if s.role == ProcessRole.trainer]

    def _run(self) -> int:
        self.faults.clear()  # an earlier run's heartbeats and crash reports in this run dir
        engines = [self._start(s) for s in self.specs if s.role == ProcessRole.engine]
        targets = [HealthTarget(c.name, c.spec.health_url, c) for c in engines if c.spec.health_url]
        remote = (
            [HealthTarget(name, url) for name, url in self.remote_engines] if self._trainer_specs() else []
        )
        # With this node's engines only, the trainer starts now: it waits for them itself, so its imports and
        # model load overlap theirs. Engines on other nodes are waited for first (their node may never come).
        early = not remote
        if early:
            self._start_others()
        failure = self._wait_healthy(targets + remote)
        if self._interrupted():
            return INTERRUPTED
        if self.hang is not None:
            return 1
        if self._lost_node is not None:
            return self._on_node_lost(None if self._trainer_specs() else self.done_marker)
        engine_died = (
            failure is not None and failure[0].child is not None and failure[0].child.proc.poll() is not None
        )
        if failure is not None and (engine_died or not self._trainer_failed()):
            target, message = failure
            if target.child is None:
                failure_text = f"✗ {target.name} (on another node) is not healthy: {message}"
                self._print(Text(failure_text, style="bold red"), soft_wrap=True)
                log = self.run_dir / "logs" / f"{target.name}.log"
                hint = f"its log is {log} (shared run dir); that node's supervisor output says why"
                self._print(Text(hint, style="red"), soft_wrap=True)
                for line in self.liveness.watch.summary() if self.liveness is not None else []:
                    self._print(Text(line, style="red"), soft_wrap=True)
                return 1
            code = target.child.proc.poll()
            reason = describe_exit(code) if code is not None else f"is not healthy: {message}"
            self._report_failure(target.child, reason)
            return self._exit_code(code)
        if not early:
            self._start_others()
        trainers = [c for c in self.children if c.spec.role == ProcessRole.trainer]
        watch = self.done_marker if not trainers else None
        if watch is not None:
            self._print(Text(f"serving rollouts until {watch.path} appears", style="dim"))
        if self.live:
            self._display = Live(self.progress.renderable(), console=self.console, auto_refresh=False)
            self._display.start()
        last_refresh = 0.0
        while True:
            if self._interrupted():
                return INTERRUPTED
            if time.monotonic() - last_refresh >= 1.0:  # a /proc scan: once a second is enough
                table = self.tracker.refresh()
                last_refresh = time.monotonic()
                if self._hung(table):
                    return 1
            self._poll_metrics()
            exited = [(c, c.proc.poll()) for c in self.children if c.proc.poll() is not None]
            failed = [(c, code) for c, code in exited if code != 0 or c.spec.role != ProcessRole.trainer]
            failed = self._unless_stopping(failed)
            if failed:
                for child, code in failed:
                    self._report_failure(child, describe_exit(code) + (" unexpectedly" if code == 0 else ""))
                if any(child.spec.role == ProcessRole.trainer for child, _ in failed):
                    if self._after_failed_push():
                        return FAILED_PUSH_EXIT
                    self._explain_by_peers()
                if watch is not None:
                    self._print(
                        Text(
                            f"this node only serves rollouts: its engines must run until {watch.path} "
                            "appears, so the run cannot go on",
                            style="red",
                        ),
                        soft_wrap=True,
                    )
                return self._exit_code(failed[0][1])
            if trainers and all(c.proc.returncode == 0 for c in trainers):
                return self._trainers_done()
            if watch is not None and watch.appeared():
                return self._on_done(watch)
            if self._node_lost():
                if trainers and self._stopped.read() is not None:  # stopped at a step boundary: expected
                    return self._trainers_done()
                return self._on_node_lost(watch)
            time.sleep(self.poll_s)

    def _start_others(self) -> None:
        for spec in self.specs:
            if spec.role != ProcessRole.engine:
                self._start(spec)

    def _trainer_failed(self) -> bool:
        trainers = (c for c in self.children if c.spec.role == ProcessRole.trainer)
        return any(c.proc.poll() not in (None, 0) for c in trainers)

    def _node_lost(self, stopped_only: bool = False) -> bool:
        """Beat this node's heartbeat; True (the message kept) once a node this one depends on is lost."""
        if self.liveness is not None and self._lost_node is None:
            self._lost_node = self.liveness.poll(stopped_only)
        return self._lost_node is not None

    def _on_node_lost(self, marker: DoneMarker | None = None) -> int:
        if marker is not None and marker.appeared():  # node 0 writes DONE just before its last heartbeat
            return self._on_done(marker)
        self._failure = self._lost_node or ""
        self._print(Text(f"✗ {self._lost_node}", style="bold red"), soft_wrap=True)
        self._print(Text("the run cannot go on without that node: stopping this one", style="red"))
        return 1

    def _explain_by_peers(self) -> None:
        """A trainer failed: name a node this one depends on that stopped too (the likelier cause), or say
        what was last heard from each."""
        if self.liveness is None or not self.liveness.watch.nodes:
            return
        lost = self._lost_node or self.liveness.settle(wait_s=2.0)
        for line in [lost] if lost else self.liveness.watch.summary():
            self._print(Text(line, style="red" if lost else "dim"), soft_wrap=True)
        if not lost:
            self._name_unreachable()

    def _on_done(self, marker: DoneMarker) -> int:
        status = marker.status()
        if status == FINISHED:
            self._print(
                Text(f"the trainer finished ({marker.path}): stopping this node's engines", style="green")
            )
            return 0
        if status == STOPPED:
            self._print(
                Text(f"the trainer stopped at a step boundary ({marker.path}): stopping this node's engines"),
                soft_wrap=True,
            )
            return STOPPED_EXIT
        self._print(
            Text(
                f"the run ended with status {status!r} ({marker.path}): see the trainer's log on node 0 "
                f"({self.run_dir / 'logs'})",
                style="bold red",
            ),
            soft_wrap=True,
        )
        return 1

    @staticmethod
    def _exit_code(code: int | None) -> int:
        if code is None or code == 0:
            return 1
        return 128 - code if code < 0 else code

    def _atexit(self) -> None:
        """Last resort (an exception escaped, the interpreter is exiting): kill everything now."""
        with contextlib.suppress(Exception):
            self.tracker.kill_all()
