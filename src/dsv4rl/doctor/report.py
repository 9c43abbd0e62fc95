"""Run every check and present the verdicts: a rich table, or `{"checks": [...], "summary": {...}}`."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from dsv4rl.config.schema import Config
from dsv4rl.doctor import checks_env, checks_host, checks_network, checks_node, checks_sandbox
from dsv4rl.doctor.bandwidth import probe_bandwidth
from dsv4rl.doctor.context import Context
from dsv4rl.doctor.facts import gather_facts
from dsv4rl.doctor.probe import SystemProbe
from dsv4rl.doctor.verdict import Check, Status

CheckFn = Callable[[Context], Check]
ALL_CHECKS: tuple[CheckFn, ...] = (
    *checks_node.CHECKS,
    *checks_host.CHECKS,
    *checks_env.CHECKS,
    *checks_network.CHECKS,
    *checks_sandbox.CHECKS,
)
STATUS_STYLE = {Status.PASS: "green", Status.WARN: "yellow", Status.FAIL: "bold red", Status.SKIP: "dim"}


@dataclass
class DoctorReport:
    checks: list[Check]
    hostname: str
    recipe: str | None
    gpus: str
    seconds: float = 0.0

    @property
    def exit_code(self) -> int:
        """1 when any check failed: a run here would not start or would break."""
        return 1 if any(c.status is Status.FAIL for c in self.checks) else 0

    def by_name(self) -> dict[str, Check]:
        return {c.name: c for c in self.checks}

    def summary(self) -> dict[str, Any]:
        counts = Counter(c.status for c in self.checks)
        return {
            **{status.value: counts.get(status, 0) for status in Status},
            "hostname": self.hostname,
            "recipe": self.recipe,
            "gpus": self.gpus,
            "seconds": round(self.seconds, 3),
            "exit_code": self.exit_code,
        }

    def to_json(self) -> dict[str, Any]:
        return {"checks": [c.to_dict() for c in self.checks], "summary": self.summary()}


def _run_one(check: CheckFn, ctx: Context) -> Check:
    """A check that crashes becomes a FAIL naming the error, never a traceback instead of the report."""
    try:
        return check(ctx)
    except Exception as error:  # the report must survive any one check
        name = check.__name__.removeprefix("check_")
        return Check(f"doctor.{name}", Status.FAIL, f"the check crashed: {type(error).__name__}: {error}",
                     "report this as a dsv4rl bug (with `dsv4rl doctor --json`)")  # fmt: skip


def run_checks(
    probe: SystemProbe,
    cfg: Config | None,
    bandwidth: bool = False,
    checks: Iterable[CheckFn] = ALL_CHECKS,
) -> DoctorReport:
    """Every check against what `probe` reads; `cfg` None: no recipe (recipe checks SKIP).
    `bandwidth`: also time collectives across the node's devices (`--probe`, seconds)."""
    start = time.monotonic()
    facts = gather_facts(probe)
    ctx = Context(probe, facts, cfg)
    results = [_run_one(check, ctx) for check in checks]
    if bandwidth:
        results += probe_bandwidth(probe, facts)
    gpus = f"{len(facts.gpus)} x {facts.gpus[0].name}" if facts.has_gpu else "none (no GPU on this machine)"
    return DoctorReport(
        checks=results,
        hostname=facts.hostname,
        recipe=None if cfg is None else cfg.recipe,
        gpus=gpus,
        seconds=time.monotonic() - start,
    )


def render(report: DoctorReport, console: Console) -> None:
    """The table, then one line: counts, and what to do."""
    title = f"dsv4rl doctor: {report.hostname}" + (f", recipe {report.recipe}" if report.recipe else "")
    table = Table(title=title, show_lines=False, expand=False)
    table.add_column("check", style="bold", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("detail", overflow="fold")
    table.add_column("remedy", overflow="fold", style="cyan")
    for check in report.checks:
        style = STATUS_STYLE[check.status]
        table.add_row(check.name, Text(check.status.value, style=style), check.detail, check.remedy)
    console.print(table)
    summary = report.summary()
    counts = ", ".join(f"{summary[s.value]} {s.value}" for s in Status)
    verdict = (
        Text("FAIL: fix the FAIL rows before a run", style="bold red")
        if report.exit_code
        else Text("no FAIL", style="green")
    )
    console.print(Text(f"GPUs: {report.gpus}; {counts} ({report.seconds:.2f} s). "), verdict)
