"""How a run stops: the signals the supervisor received, the graceful stop at a step boundary, and the
tear-down of every process.

In a training run (`stop_grace_s` > 0) the first SIGTERM or SIGUSR1 is a graceful stop: the trainer is
asked to stop at its next step boundary (`<run_dir>/STOP`, `dsv4rl.faults.stop`), checkpoints and exits,
and the run returns STOPPED_EXIT (75) with the command that resumes it; a second signal, or
`stop_grace_s` without the trainer gone, stops every child at once (130). Ctrl-C always stops at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from rich.text import Text

from dsv4rl.config.choices import ProcessRole
from dsv4rl.faults.stop import STOP_SIGNALS, STOPPED_EXIT, StoppedRecord, request_stop
from dsv4rl.launcher.process_table import Child, ProcessTable, Say, describe_exit

INTERRUPTED = 130
STOPPED = "stopped"  # the DONE marker's and the summary's status of a graceful stop


class StopProtocol:
    """The signals so far and what they mean. `trainers_here`: this node runs the trainer (node 0)."""

    def __init__(
        self,
        table: ProcessTable,
        run_dir: Path,
        say: Say,
        *,
        trainers_here: bool,
        grace_s: float,
        stop_grace_s: float,
        resume_hint: str,
    ):
        self.table = table
        self.run_dir = run_dir
        self._say = say
        self.trainers_here = trainers_here
        self.grace_s = grace_s
        self.stop_grace_s = stop_grace_s
        self.resume_hint = resume_hint
        self.signals: list[int] = []
        self.stopping: float | None = None  # when the graceful stop began (monotonic)
        self._at_once = False  # a signal stops every process now (said once)
        self._gone_while_stopping: set[str] = set()  # children that exited during a graceful stop
        self.stopped = StoppedRecord(run_dir)  # trainer rank 0's record of a stop at a step boundary
        self.message = ""  # after the summary: the step stopped at and how to resume

    def on_signal(self, signum: int, frame: object) -> None:
        self.signals.append(signum)

    def interrupted(self) -> bool:
        """Whether a signal stops every process now. In a training run the first SIGTERM or SIGUSR1 starts a
        graceful stop instead (`begin_stop`); then a second signal, or `stop_grace_s` gone by, stops all."""
        if self._at_once or not self.signals:
            return self._at_once
        first = signal.Signals(self.signals[0]).name
        if self.stopping is None and not self.begin_stop(self.signals[0]):
            why = f"{first} received: stopping every process"
        elif len(self.signals) > 1:
            second = signal.Signals(self.signals[1]).name
            why = f"{second} received during the graceful stop: stopping every process now"
        elif time.monotonic() - self.stopping > self.stop_grace_s:
            why = (
                f"the trainer did not stop within run.stop_grace_s={self.stop_grace_s:g} s: stopping every "
                "process now"
            )
        else:
            return False
        self._at_once = True
        self._say(Text(why, style="bold yellow"), soft_wrap=True)
        return True

    def begin_stop(self, signum: int) -> bool:
        """A graceful stop when it can be one: ask the trainer (`<run_dir>/STOP`, read by trainer rank 0 at
        each step boundary) and keep watching. Not before the trainer has left its start (nothing to save)."""
        if signum not in STOP_SIGNALS or self.stop_grace_s <= 0:
            return False
        if self.trainers_here and not self.table.trainer_past_its_engine_wait():
            return False
        name = signal.Signals(signum).name
        try:
            path = request_stop(self.run_dir, f"{name} to the supervisor (pid {os.getpid()})")
        except OSError as error:
            self._say(Text(f"{name} received; the stop request cannot be written ({error})", style="red"))
            return False
        self.stopping = time.monotonic()
        if self.trainers_here:
            text = (
                f"{name} received: the trainer ends its step, writes a checkpoint and exits ({path}; at most "
                f"run.stop_grace_s={self.stop_grace_s:g} s, a second signal stops every process at once)"
            )
        else:
            text = (
                f"{name} received: the trainer (node 0) stops at its next step boundary ({path}); this node "
                "serves until then (a second signal stops it at once)"
            )
        self._say(Text(text, style="bold yellow"), soft_wrap=True)
        return True

    def unless_stopping(self, failed: list[tuple[Child, int]]) -> list[tuple[Child, int]]:
        """During a graceful stop only a trainer's exit counts: engines may go first (Slurm signals every
        process of a job), while the trainer still writes its checkpoint."""
        if self.stopping is None:
            return failed
        for child, code in failed:
            if child.spec.role != ProcessRole.trainer and child.name not in self._gone_while_stopping:
                self._gone_while_stopping.add(child.name)
                self._say(Text(f"{child.name} {describe_exit(code)} while the run stops", style="dim"))
        return [(child, code) for child, code in failed if child.spec.role == ProcessRole.trainer]

    def trainers_done(self) -> int:
        """Every trainer exited 0: the run finished, or it stopped at a step boundary (STOPPED_EXIT)."""
        record = self.stopped.read()
        if record is None:
            return 0
        step, checkpoint = record.get("step"), record.get("checkpoint")
        saved = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint yet: a resumed run starts over"
        how = self.resume_hint or "the same command with resume=auto"
        self.message = f"stopped after step {step} ({saved}); continue with: {how}"
        return STOPPED_EXIT

    def stop_all(self) -> None:
        """SIGTERM every child's group and orphaned descendants (SIGINT to the trainer's: torchrun passes it
        on, and it ends a rank at once), wait `grace_s`, then SIGKILL the rest."""
        table, tracker = self.table, self.table.tracker
        if table.any_alive():
            for child in table.trainers():
                if child.proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(child.proc.pid, signal.SIGINT)
            tracker.signal_groups(signal.SIGTERM)
            deadline = time.monotonic() + self.grace_s
            # A signal during the polite wait (a second Ctrl-C) ends it.
            signals = len(self.signals)
            while table.any_alive() and time.monotonic() < deadline and len(self.signals) == signals:
                tracker.signal_orphans(signal.SIGTERM)  # descendants whose parent died meanwhile
                time.sleep(0.05)
        if table.any_alive():
            tracker.kill_all()
            deadline = time.monotonic() + 5.0
            while table.any_alive() and time.monotonic() < deadline:
                time.sleep(0.05)
