"""What the supervisor says when a run fails: the failing child's root cause (its exception, or the rank
and signal torchrun saw) or else its log tail; a hang, with every process's phase and Python stacks
(`dsv4rl.launcher.watchdog`); engines another node no longer reaches; a weight push that spent the
engines; a peer node that stopped first. `failure` keeps the one line the heartbeat and the caller get.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

from rich.panel import Panel
from rich.text import Text

from dsv4rl.config.choices import ProcessRole
from dsv4rl.faults.failed_push import FailedPushRecord
from dsv4rl.launcher.node_liveness import NodeLiveness
from dsv4rl.launcher.process_table import Child, HealthTarget, ProcessTable, Say, log_tail
from dsv4rl.launcher.reachability import unreachable_engines
from dsv4rl.launcher.watchdog import Hang, describe, find_hang


class FailureNarration:
    """Says why the run failed; `trainers_here`: this node runs the trainer (node 0)."""

    def __init__(
        self,
        table: ProcessTable,
        run_dir: Path,
        say: Say,
        *,
        trainers_here: bool,
        tail_lines: int,
        step_timeout_s: float,
        remote_engines: Sequence[tuple[str, str]],
        node_addrs: Sequence[str],
    ):
        self.table = table
        self.run_dir = run_dir
        self._say = say
        self.trainers_here = trainers_here
        self.tail_lines = tail_lines
        self.step_timeout_s = step_timeout_s
        self.remote_engines = list(remote_engines)
        self.node_addrs = list(node_addrs)  # cluster.node_addrs: which node a remote engine's address is
        self.failure = ""  # what failed here, for the final heartbeat
        self.root_cause: str | None = None  # the failed process's own words (its crash report)
        self.hang: Hang | None = None
        self.failed_push = FailedPushRecord(run_dir)  # rank 0's record of a push that spent the engines

    def report_failure(self, child: Child, reason: str) -> None:
        faults = self.table.faults
        if child.spec.role != ProcessRole.trainer and child.proc.returncode is not None:
            reason += faults.during(child.spec, child.proc.pid)  # an engine: in which work it died
        self.failure = f"{child.name} {reason}"
        self._say(Text(f"✗ {child.name} {reason}", style="bold red"), soft_wrap=True)
        if self._show_root_cause(child):
            return
        tail = log_tail(child.spec.log_path, self.tail_lines, child.log_start)
        body = Text("\n".join(tail) if tail else "(empty log)", style="red")
        title = f"last {len(tail)} lines of {child.spec.log_path}"
        self._say(Panel(body, title=title, border_style="red", expand=False))

    def _show_root_cause(self, child: Child) -> bool:
        """Print why `child` failed in its own words; True when its traceback stands in for the log tail."""
        log_text = "\n".join(log_tail(child.spec.log_path, 5000, child.log_start))  # torchrun's block
        cause = self.table.faults.root_cause(child.spec, log_text)
        if cause is None:
            return False
        self.root_cause = self.root_cause or cause.headline
        self._say(Text(f"root cause: {cause.headline}", style="bold red"), soft_wrap=True)
        for line in cause.others:
            self._say(Text(f"  also: {line}", style="red"), soft_wrap=True)
        if not cause.traceback:
            return False
        lines = cause.traceback.rstrip().splitlines()[-self.tail_lines :]
        title = f"{cause.process}'s traceback"
        self._say(Panel(Text("\n".join(lines), style="red"), title=title, border_style="red", expand=False))
        self._say(Text(f"crash report: {cause.source}", style="dim"), soft_wrap=True)
        self._say(Text(f"full log: {child.spec.log_path}", style="dim"), soft_wrap=True)
        return True

    def hung(self, table: dict, recover: Callable[[Hang], bool] | None = None) -> bool:
        """The hang watchdog: on a trainer phase without progress for `step_timeout_s`, every child with a
        heartbeat dumps its Python stacks and the run stops; unless `recover(hang)` dealt with it (a hung
        engine killed to be restarted)."""
        if self.step_timeout_s <= 0:
            return False
        faults = self.table.faults
        seen = faults.heartbeats(set(self.table.tracker.alive(table)))
        watched = [item.beat for item in seen if item.role == ProcessRole.trainer]
        servers = [item.beat for item in seen if item.role != ProcessRole.trainer]
        now = time.time()
        self.hang = find_hang(watched, servers, self.step_timeout_s, now)
        if self.hang is None:
            return False
        if recover is not None and recover(self.hang):
            self.hang = None
            return False
        headline = self.hang.headline(self.step_timeout_s)
        self.failure = headline
        self._say(Text(f"✗ {headline}", style="bold red"), soft_wrap=True)
        dumps = faults.dump_stacks(seen, headline)
        lines = [describe(item.beat, now) + ("" if item.local else " (another node)") for item in seen]
        body = Text("\n".join(lines), style="red")
        self._say(Panel(body, title="every process at the hang", border_style="red", expand=False))
        for path, came in dumps.items():  # whole paths, never wrapped: they are copied into editors
            self._say(Text(f"Python stacks: {path}" + ("" if came else " (no dump came)")), soft_wrap=True)
        self.name_unreachable()
        return True

    def name_unreachable(self) -> None:
        """Multi-node, after the trainer failed or hung: name the engines on other nodes that the network
        no longer reaches (a partition: their nodes still beat in the shared run dir)."""
        if not (self.remote_engines and self.trainers_here):
            return
        for line in unreachable_engines(self.remote_engines, self.node_addrs):
            self.failure = self.failure or line
            self._say(Text(f"✗ {line}", style="bold red"), soft_wrap=True)

    def remote_unhealthy(self, target: HealthTarget, message: str, liveness: NodeLiveness | None) -> None:
        """An engine on another node never answered: its log is in the shared run dir, its node's
        supervisor says why."""
        self._say(Text(f"✗ {target.name} (on another node) is not healthy: {message}", style="bold red"),
                  soft_wrap=True)  # fmt: skip
        log = self.run_dir / "logs" / f"{target.name}.log"
        hint = f"its log is {log} (shared run dir); that node's supervisor output says why"
        self._say(Text(hint, style="red"), soft_wrap=True)
        for line in liveness.watch.summary() if liveness is not None else []:
            self._say(Text(line, style="red"), soft_wrap=True)

    def after_failed_push(self) -> bool:
        """The trainer failed after recording a weight push that spent the engines (`<run_dir>/FAILED_PUSH`):
        say so; the run then ends with FAILED_PUSH_EXIT (fresh engines and resume=auto carry on)."""
        record = self.failed_push.read()
        if record is None:
            return False
        self._say(
            Text(
                f"the weight push of step {record.get('step')} failed on engines whose weight "
                f"post-processing is not idempotent ({self.failed_push.path}): they cannot take another "
                "push, so the run ends; fresh engines and resume=auto continue it",
                style="bold red",
            ),
            soft_wrap=True,
        )
        return True

    def explain_by_peers(self, liveness: NodeLiveness | None, lost_node: str | None) -> None:
        """A trainer failed: name a node this one depends on that stopped too (the likelier cause), or say
        what was last heard from each."""
        if liveness is None or not liveness.watch.nodes:
            return
        lost = lost_node or liveness.settle(wait_s=2.0)
        for line in [lost] if lost else liveness.watch.summary():
            self._say(Text(line, style="red" if lost else "dim"), soft_wrap=True)
        if not lost:
            self.name_unreachable()
