"""The node supervisor: start the plan's processes, wait for the engines, watch, and tear everything down.

Rules: the trainer starts with this node's engines and waits for them itself (their start-ups overlap),
while the supervisor waits for their /health_generate too, to name an engine that dies or never answers;
engines on other nodes must answer before the trainer starts. The run succeeds when every trainer exits 0;
any other exit (a crash, a kill, an engine quitting early) stops every child and says why
(`failure_narration`); signals and the graceful stop are `stop_protocol`'s, the table of who runs
`process_table`'s. Hang watchdog: a trainer phase without progress for `step_timeout_s` makes every
child dump its Python stacks (`logs/stacks-<process>.txt`), then the run stops naming the phase and the
process that did not advance (`dsv4rl.launcher.watchdog`); the children's side is `dsv4rl.faults`.

Multi-node: node 0 writes `<run_dir>/DONE` when its trainer exits (`dsv4rl.launcher.marker`); a node that
only runs engines serves until that marker appears, then stops its engines and exits 0 (1 if the marker
says the run failed, or if one of its engines dies first). Every node keeps a heartbeat in the run dir and
stops, naming the node, when one it depends on stops, goes silent or never comes up
(`dsv4rl.launcher.node_liveness`).
"""

from __future__ import annotations

import atexit
import contextlib
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.panel import Panel
from rich.text import Text

from dsv4rl.config.choices import ProcessRole
from dsv4rl.faults import engine_ports, restart_requests
from dsv4rl.faults.failed_push import FAILED_PUSH_EXIT
from dsv4rl.faults.proc_tree import become_subreaper, kill_group
from dsv4rl.faults.stop import STOP_SIGNALS, STOPPED_EXIT
from dsv4rl.launcher.child_faults import ChildFaults
from dsv4rl.launcher.engine_probe import SilentEngineProbe, requests_open, silent_engines
from dsv4rl.launcher.engine_restarts import EngineRestarts, listen_address, on_port, port_for_restart
from dsv4rl.launcher.failure_narration import FailureNarration
from dsv4rl.launcher.marker import FINISHED, DoneMarker
from dsv4rl.launcher.node_liveness import NodeLiveness
from dsv4rl.launcher.plan import METRICS_FILE, ProcessSpec
from dsv4rl.launcher.process_table import Child, HealthTarget, ProcessTable, describe_exit, wait_healthy
from dsv4rl.launcher.procs import Tracker
from dsv4rl.launcher.progress import MetricsTail, RunProgress
from dsv4rl.launcher.stop_protocol import INTERRUPTED, STOPPED, StopProtocol
from dsv4rl.launcher.watchdog import Hang

FAILED_PUSH = "failed_push"  # the DONE marker's and the summary's status of a push that spent the engines


class Supervisor:
    """Runs `specs` (engines, then trainers) to completion; `run()` returns the exit code.

    `remote_engines`: (name, health URL) of engines on other nodes, waited for before the trainer starts.
    `done_marker`: with trainers in `specs` (node 0 only), written when the run ends; without trainers
    (a rollout-only node), the run ends when it appears. `show_progress`: tail the metrics (one node).
    `step_timeout_s`: the hang watchdog's limit (0: off). `max_restarts`: how often each engine of this node
    that dies or hangs is restarted while the run goes on (`dsv4rl.launcher.engine_restarts`; 0: an
    engine failure stops the run), out of `engines` in the run of which `min_alive` must answer; one whose
    port another process holds is restarted on a free port (with `engine_port_offsets` free above it).
    `stop_grace_s`: how long a graceful stop may take
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
        max_restarts: int = 0,
        engines: int = 1,
        min_alive: int = 1,
        health_timeout_s: float = 10.0,
        engine_port_offsets: Sequence[int] = (),
    ):
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"process names must be unique, got {names}")
        self.specs = list(specs)
        self.run_dir = Path(run_dir)
        self.console = console or Console()
        self.live = self.console.is_terminal if live is None else live and self.console.is_terminal
        self.startup_timeout_s = startup_timeout_s
        self.poll_s = poll_s
        self.remote_engines = list(remote_engines)
        self.done_marker = done_marker
        self.show_progress = show_progress
        self.liveness = liveness  # multi-node: this node's heartbeat, and the nodes it depends on
        self._lost_node: str | None = None  # why a node this one depends on is gone
        self.status: str | None = None  # finished, stopped, failed, hung or interrupted, once run() returns
        # The children's heartbeats, crash reports and stack dumps (and the other nodes' engines' heartbeats).
        faults = ChildFaults(self.specs, [name for name, _ in remote_engines])
        self.table = ProcessTable(faults, self._print)
        trainers_here = bool(self._trainer_specs())
        self.stop_protocol = StopProtocol(
            self.table,
            self.run_dir,
            self._print,
            trainers_here=trainers_here,
            grace_s=grace_s,
            stop_grace_s=stop_grace_s,
            resume_hint=resume_hint,
        )
        self.narration = FailureNarration(
            self.table,
            self.run_dir,
            self._print,
            trainers_here=trainers_here,
            tail_lines=tail_lines,
            step_timeout_s=step_timeout_s,
            remote_engines=self.remote_engines,
            node_addrs=node_addrs,
        )
        self.restarts = EngineRestarts(max_restarts, engines, min_alive)
        self.engine_port_offsets = tuple(engine_port_offsets)  # ports each engine opens above its own
        # engines that write no heartbeat (SGLang): probed while the trainer has requests open, so that a
        # hung one is restarted rather than found by the step watchdog, which stops the run
        probed = silent_engines(self.specs) if max_restarts > 0 else []
        self.silent_probe = SilentEngineProbe(probed, health_timeout_s)
        self._not_restarted: set[str] = set()  # found hung by the probe, refused a restart: said once
        self._requested: set[str] = set()  # engines the trainer asked to restart, killed, not yet started
        # after a hung engine was killed to restart it, the trainer waits on it no longer: give it a fresh
        # step_timeout_s to resend that engine's requests before its phase counts as hung
        self._hang_grace_until = 0.0
        self.progress = RunProgress(total_steps)
        self.log_every = max(1, log_every)  # train.log_every: one printed line every that many steps
        self._metrics = MetricsTail(self.run_dir / METRICS_FILE, only_new=True)  # never an earlier run's
        self._display: Live | None = None

    # The names the launcher and the tests read.
    @property
    def children(self) -> list[Child]:
        return self.table.children

    @property
    def tracker(self) -> Tracker:
        return self.table.tracker

    @property
    def hang(self) -> Hang | None:
        return self.narration.hang

    @property
    def root_cause(self) -> str | None:
        return self.narration.root_cause

    @property
    def stop_grace_s(self) -> float:
        return self.stop_protocol.stop_grace_s

    @stop_grace_s.setter
    def stop_grace_s(self, seconds: float) -> None:
        self.stop_protocol.stop_grace_s = seconds

    @property
    def failure(self) -> str | None:
        """Why the run did not finish, in one line (the root cause when a crash report gave one)."""
        return self.narration.root_cause or self.narration.failure or None

    # ----------------------------------------------------------------------------------- output
    def _print(self, *objects: object, soft_wrap: bool = False) -> None:
        (self._display.console if self._display else self.console).print(*objects, soft_wrap=soft_wrap)

    def _poll_notices(self) -> None:
        """Print what the children asked the console to show (`dsv4rl.faults.notices`)."""
        for line in self.table.faults.new_notices():
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
    def _wait_healthy(self, engines: list[HealthTarget]) -> tuple[HealthTarget, str] | None:
        """None when all are healthy; else (engine, reason)."""

        def should_abort(target: HealthTarget) -> bool:
            table = self.tracker.refresh()  # remember what the engines spawn while they load
            exited = target.child is not None and target.child.proc.poll() is not None
            # A trainer started early waits for the engines itself and may be past that wait while this one
            # still polls: an engine hung in the trainer's first generate never answers either, so the
            # watchdog judges here too, or a 30 s hang would be reported as a 300 s startup failure.
            hung = self.hang is not None or self.narration.hung(table)
            # a trainer that already failed ends the wait: the watch loop below reports it
            return (
                exited
                or hung
                or self.table.trainer_failed()
                or self.stop_protocol.interrupted()
                or self._node_lost(stopped_only=True)
            )

        return wait_healthy(
            engines,
            self.startup_timeout_s,
            should_abort,
            self.table.trainer_past_its_engine_wait,
            self._print,
        )

    # ----------------------------------------------------------------------------------- main loop
    def run(self) -> int:
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, *STOP_SIGNALS):
                handlers[sig] = signal.signal(sig, self.stop_protocol.on_signal)
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
            running = self.table.running()
            if running:
                self._print(Text(f"stopping {', '.join(running)} ...", style="dim"))
            self.stop_protocol.stop_all()
            self.silent_probe.close()
            atexit.unregister(self._atexit)
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            if self.done_marker is not None and self._trainer_specs():
                with contextlib.suppress(OSError):
                    self.done_marker.write(status)
                    self._print(Text(f"wrote {self.done_marker.path} ({status})", style="dim"))
            if self.liveness is not None:  # after DONE: a peer that sees this node stopped finds the marker
                self.liveness.stop(status, self.narration.failure)
            self._poll_metrics()
            style = {"finished": "bold green", "interrupted": "bold yellow", STOPPED: "bold yellow"}
            style = style.get(status, "bold red")
            if self.show_progress:
                summary = self.progress.summary(self.run_dir, status)
                self.console.print(Panel(summary, border_style=style, expand=False))
            else:
                self.console.print(Text(f"{status} (run dir {self.run_dir})", style=style))
            if self.stop_protocol.message:
                self.console.print(Text(self.stop_protocol.message, style="bold yellow"), soft_wrap=True)

    def _trainer_specs(self) -> list[ProcessSpec]:
        return [s for s in self.specs if s.role == ProcessRole.trainer]

    def _run(self) -> int:
        self.table.faults.clear()  # an earlier run's heartbeats and crash reports in this run dir
        engines = [self.table.start(s) for s in self.specs if s.role == ProcessRole.engine]
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
        if self.stop_protocol.interrupted():
            return INTERRUPTED
        if self.hang is not None:
            return 1
        if self._lost_node is not None:
            return self._on_node_lost(None if self._trainer_specs() else self.done_marker)
        engine_died = (
            failure is not None and failure[0].child is not None and failure[0].child.proc.poll() is not None
        )
        if failure is not None and (engine_died or not self.table.trainer_failed()):
            target, message = failure
            if target.child is None:
                self.narration.remote_unhealthy(target, message, self.liveness)
                return 1
            code = target.child.proc.poll()
            reason = describe_exit(code) if code is not None else f"is not healthy: {message}"
            self.narration.report_failure(target.child, reason)
            return self._exit_code(code)
        if not early:
            self._start_others()
        trainers = self.table.trainers()
        watch = self.done_marker if not trainers else None
        if watch is not None:
            self._print(Text(f"serving rollouts until {watch.path} appears", style="dim"))
        if self.live:
            self._display = Live(self.progress.renderable(), console=self.console, auto_refresh=False)
            self._display.start()
        return self._watch(trainers, watch)

    def _watch(self, trainers: list[Child], watch: DoneMarker | None) -> int:
        """Every child running: watch until the trainers finish, one fails or hangs, or the run stops."""
        last_refresh = 0.0
        while True:
            if self.stop_protocol.interrupted():
                return INTERRUPTED
            if time.monotonic() - last_refresh >= 1.0:  # a /proc scan: once a second is enough
                table = self.tracker.refresh()
                last_refresh = time.monotonic()
                watching = time.time() >= self._hang_grace_until
                if watching and self.narration.hung(table, self._kill_hung_engine):
                    return 1
                self._probe_silent_engines()
                self._serve_restart_requests()
                for name in self.restarts.answered():
                    self._print(Text(f"{name} answers again: it rejoins at the trainer's next weight sync"))
            self._poll_metrics()
            exited = [(c, c.proc.poll()) for c in self.children if c.proc.poll() is not None]
            failed = [(c, code) for c, code in exited if code != 0 or c.spec.role != ProcessRole.trainer]
            failed = self.stop_protocol.unless_stopping(failed)
            failed = [(c, code) for c, code in failed if not self._restart_engine(c, code)]
            if failed:
                for child, code in failed:
                    self.narration.report_failure(
                        child, describe_exit(code) + (" unexpectedly" if code == 0 else "")
                    )
                if any(child.spec.role == ProcessRole.trainer for child, _ in failed):
                    if self.narration.after_failed_push():
                        return FAILED_PUSH_EXIT
                    self.narration.explain_by_peers(self.liveness, self._lost_node)
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
                return self.stop_protocol.trainers_done()
            if watch is not None and watch.appeared():
                return self._on_done(watch)
            if self._node_lost():
                # stopped at a step boundary: the trainer's node is expected to go
                if trainers and self.stop_protocol.stopped.read() is not None:
                    return self.stop_protocol.trainers_done()
                return self._on_node_lost(watch)
            time.sleep(self.poll_s)

    # ----------------------------------------------------------------------------------- engine restarts
    def _restart_engine(self, child: Child, code: int) -> bool:
        """An engine of this node ended: start it again when `engine.max_restarts` allows (True)."""
        if child.spec.role != ProcessRole.engine or self.stop_protocol.stopped.read() is not None:
            return False
        requested = child.name in self._requested  # the trainer asked for it and waits for it
        self._requested.discard(child.name)
        log_dir = self.table.faults.log_dir(child.spec)
        refusal = self.restarts.refusal(child.name, requested)
        if refusal is not None:
            if self.restarts.max_restarts > 0:
                self._print(Text(f"✗ not restarted: {refusal}", style="bold red"), soft_wrap=True)
            if requested:
                restart_requests.answer_request(log_dir, child.name, False, refusal)
            return False
        kill_group(child.proc.pid)  # whatever is left of it lets go of its port
        spec, ports = self._spec_for_restart(child, log_dir)
        count = self.restarts.restarted(child.name, spec.health_url)
        meanwhile = "waits for it" if requested else "sends its requests to the other engines meanwhile"
        self._print(
            Text(
                f"! {child.name} {describe_exit(code)}: restarting it with its command and {ports} (restart "
                f"{count} of engine.max_restarts={self.restarts.max_restarts}); the trainer {meanwhile}",
                style="bold yellow",
            ),
            soft_wrap=True,
        )
        self.table.restart(child, spec)
        if requested:
            restart_requests.answer_request(log_dir, child.name, True)
        return True

    def _spec_for_restart(self, child: Child, log_dir: Path) -> tuple[ProcessSpec, str]:
        """The engine's spec as it restarts, and the console's words for its ports: its own, or a free port
        when another process holds its own (the move recorded for the trainer: `faults.engine_ports`)."""
        port = port_for_restart(child.spec, self.engine_port_offsets)
        if port is None:
            return child.spec, "ports"
        was = listen_address(child.spec)[1]
        spec = on_port(child.spec, port)
        engine_ports.record_move(log_dir, child.name, port, was)
        if spec.health_url:
            self.silent_probe.follow(child.name, spec.health_url)
        return spec, f"port {port} (another process holds its port {was})"

    def _serve_restart_requests(self) -> None:
        """The trainer asked for engines of this node to be restarted (a failed push left their weights
        unknown, `dsv4rl.faults.restart_requests`): kill each (its exit restarts it), or answer why not."""
        for child in self.table.engines():
            log_dir = self.table.faults.log_dir(child.spec)
            request = restart_requests.pending_request(log_dir, child.name)
            if request is None or child.name in self._requested:
                continue
            if child.name in self.restarts.starting:  # it died in the push: restarting already
                restart_requests.answer_request(log_dir, child.name, True, "restarting already")
                continue
            refusal = self.restarts.refusal(child.name, requested=True)
            if refusal is not None:
                restart_requests.answer_request(log_dir, child.name, False, refusal)
                text = f"✗ {child.name} is not restarted as the trainer asked: {refusal}"
                self._print(Text(text, style="bold red"), soft_wrap=True)
                continue
            self._requested.add(child.name)
            why = request.get("reason", "")
            text = f"! the trainer asks for {child.name} to be restarted ({why}): killing it to restart it"
            self._print(Text(text, style="bold yellow"), soft_wrap=True)
            if child.proc.poll() is None:
                kill_group(child.proc.pid)

    def _kill_hung_engine(self, hang: Hang) -> bool:
        """The watchdog found `hang`: when its culprit is an engine of this node that may be restarted,
        kill it (its exit restarts it, `_restart_engine`) and let the run go on (True)."""
        return self._kill_to_restart(hang.culprit.process, hang.headline(self.narration.step_timeout_s))

    def _probe_silent_engines(self) -> None:
        """Kill, to restart it, an engine without heartbeats that stopped answering its health probe while
        the trainer had requests open (`dsv4rl.launcher.engine_probe`). One that may not be restarted is
        named once and left to the step watchdog, which stops the run as before."""
        if not self.silent_probe.targets:
            return
        trainers = self.table.faults.trainer_beats()
        for name in self.silent_probe.observe(requests_open(trainers), skip=self.restarts.starting):
            headline = f"hang: {self.silent_probe.describe(name)}"
            if self._kill_to_restart(name, headline) or name in self._not_restarted:
                continue
            self._not_restarted.add(name)
            why = self.restarts.refusal(name) or "it is not running"
            self._print(Text(f"✗ {headline}; not restarted: {why}", style="bold red"), soft_wrap=True)

    def _kill_to_restart(self, name: str, headline: str) -> bool:
        child = next((c for c in self.table.engines() if c.name == name and c.proc.poll() is None), None)
        if child is None or self.restarts.refusal(name) is not None:
            return False
        self._print(Text(f"! {headline}: killing {name} to restart it", "bold yellow"), soft_wrap=True)
        kill_group(child.proc.pid)
        # the trainer waits on that engine no longer: give it a fresh step_timeout_s to resend its requests
        self._hang_grace_until = time.time() + self.narration.step_timeout_s
        return True

    def _start_others(self) -> None:
        for spec in self.specs:
            if spec.role != ProcessRole.engine:
                self.table.start(spec)

    # ----------------------------------------------------------------------------------- other nodes
    def _node_lost(self, stopped_only: bool = False) -> bool:
        """Beat this node's heartbeat; True (the message kept) once a node this one depends on is lost."""
        if self.liveness is not None and self._lost_node is None:
            self._lost_node = self.liveness.poll(stopped_only)
        return self._lost_node is not None

    def _on_node_lost(self, marker: DoneMarker | None = None) -> int:
        if marker is not None and marker.appeared():  # node 0 writes DONE just before its last heartbeat
            return self._on_done(marker)
        self.narration.failure = self._lost_node or ""
        self._print(Text(f"✗ {self._lost_node}", style="bold red"), soft_wrap=True)
        self._print(Text("the run cannot go on without that node: stopping this one", style="red"))
        return 1

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
