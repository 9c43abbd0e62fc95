"""Putting a report together: metrics, the run's planned steps, plots, then `report.md` beside them."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from dsv4rl.faults.attempts import Attempt, earlier_attempts
from dsv4rl.faults.run_outcome import read_run_outcome
from dsv4rl.report.evals import collect_evals
from dsv4rl.report.metrics_table import MetricsTable, load_metrics_table
from dsv4rl.report.plots import PlotResult, render_plots
from dsv4rl.report.summary import RunStatus, render_summary, run_status

if TYPE_CHECKING:
    from rich.console import Console

SUMMARY_FILE = "report.md"
DEFAULT_OUT = "report"  # inside the run dir
CONFIG_FILES = ("config.yaml", "config-node0.yaml")  # single node; node 0 (which writes the metrics)


@dataclass
class Report:
    out_dir: Path
    summary: Path
    table: MetricsTable
    status: RunStatus
    plots: PlotResult
    config_note: str | None
    run_dir: Path
    attempts: list[Attempt]  # what earlier attempts left, kept by the launcher (dsv4rl.faults.attempts)


def planned_steps(run_dir: Path) -> tuple[int | None, str | None]:
    """`train.steps` of the config the run saved, and a note when it cannot be read (then None).

    Plain YAML, not the schema: a report must still work on a run made by an older or newer dsv4rl.
    """
    for name in CONFIG_FILES:
        path = run_dir / name
        if not path.is_file():
            continue
        try:
            raw = yaml.safe_load(path.read_text())
            steps = raw["train"]["steps"]
        except (yaml.YAMLError, TypeError, KeyError) as exc:
            return None, f"`{name}` has no readable train.steps ({type(exc).__name__}: {exc})"
        if isinstance(steps, bool) or not isinstance(steps, int):
            return None, f"`{name}` has train.steps={steps!r}, not an integer"
        return steps, f"`{name}`, train.steps={steps}"
    return None, "no config.yaml in the run dir: planned steps unknown"


def build_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Report:
    """Write the plots and `report.md` for `run_dir` (into `run_dir/report` unless `out_dir`).

    Raises `ReportError` when the run dir, its metrics file, or any complete line in it is missing.
    """
    run_dir = Path(run_dir)
    table = load_metrics_table(run_dir)
    out = Path(out_dir) if out_dir is not None else run_dir / DEFAULT_OUT
    steps, config_note = planned_steps(run_dir)
    idle_s = time.time() - table.path.stat().st_mtime
    status = run_status(table, steps, idle_s, read_run_outcome(run_dir))
    plots = render_plots(table, out)
    summary = out / SUMMARY_FILE
    attempts = earlier_attempts(run_dir)
    summary.write_text(render_summary(table, run_dir, status, plots, out, config_note, attempts))
    return Report(out, summary, table, status, plots, config_note, run_dir, attempts)


def print_report(report: Report, console: Console) -> None:
    """Where the files went, what was skipped, and the run's state: the command's whole output."""
    from rich.table import Table
    from rich.text import Text

    for note in report.table.notes:
        console.print(Text(f"warning: metrics.jsonl {note}", style="yellow"), soft_wrap=True)
    steps = report.table.steps
    status = report.status
    rest = status.detail if status.sentence else f"({status.detail})"
    line = Text(f"{len(steps)} steps ({steps[0]}..{steps[-1]}), run ")
    line.append(status.state, style="bold")
    console.print(line.append(f" {rest}"), highlight=False, soft_wrap=True)
    for attempt in report.attempts:
        console.print(Text(f"earlier {attempt.line()}", style="dim"), soft_wrap=True)
    console.print(f"report written to [bold]{report.out_dir}/[/]", highlight=False, soft_wrap=True)
    files = Table()
    files.add_column("file")
    files.add_column("size", justify="right")
    for path in [*report.plots.written.values(), report.summary]:
        files.add_row(path.name, f"{path.stat().st_size / 1024:.1f} KiB")
    console.print(files)
    for name, why in report.plots.skipped.items():
        console.print(f"skipped {name}.png: {why}", style="dim", highlight=False, soft_wrap=True)
    evals = collect_evals(report.run_dir)
    if evals:  # the periodic evals next to `dsv4rl eval` of the run's checkpoints
        keys = sorted({k for row in evals for k in row.scores}, key=lambda k: (k != "pass@1", k))
        scores = Table(title="eval reports")
        for column in ("step", "eval set", "by", "weights", *keys):
            scores.add_column(column, justify="right" if column in keys or column == "step" else "left")
        for row in evals:
            values = [f"{row.scores[k]:.4f}" if k in row.scores else "" for k in keys]
            step = "start" if row.step is None else str(row.step)
            scores.add_row(step, row.eval_set, row.source, row.weights, *values)
        console.print(scores)
