"""The Markdown summary of a run (`report.md`): how far it got, reward, time split, sync, eval, plot links.

Pure functions of the metrics table and what the run dir says about the run (planned steps, how long
ago the metrics were written), so the numbers can be checked against the file they came from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import median

from dsv4rl.faults.attempts import Attempt
from dsv4rl.faults.run_outcome import WORDS, RunOutcome
from dsv4rl.metrics import PACE_WINDOW, fmt_duration, pace
from dsv4rl.report.evals import collect_evals, evals_section
from dsv4rl.report.metrics_table import MetricsTable, mean
from dsv4rl.report.plots import EVAL_PREFIX, PlotResult, fmt_bytes
from dsv4rl.report.rollouts import rollouts_section

MEANS_WINDOW = 10  # steps averaged for the reward at the start and at the end
IDLE_AFTER_S = 300.0  # a run whose metrics have not grown for longer than this (and 10 steps) is stopped


@dataclass(frozen=True)
class RunStatus:
    # "finished", "stopped", "in progress", "finished or stopped" (planned steps unknown), or from the run's
    # OUTCOME record: "crashed", "hung", "interrupted", "stopped after a failed weight push"
    state: str
    detail: str
    sentence: str | None = None  # the OUTCOME record's own words: "crashed at step 12 (root cause: ...)"


def run_status(
    table: MetricsTable, planned_steps: int | None, idle_s: float, outcome: RunOutcome | None = None
) -> RunStatus:
    """From the launcher's OUTCOME record when the run has one (it knows a crash from a stop); otherwise
    finished when the last step reaches `train.steps`, in progress while the file still grows (a partial
    last line, or written within max(IDLE_AFTER_S, 10 step times)), else stopped.

    `idle_s` is the time since metrics.jsonl was last modified.
    """
    last = table.steps[-1]
    if outcome is not None and outcome.outcome != "finished":
        sentence = outcome.sentence()
        state = WORDS.get(outcome.outcome, outcome.outcome)
        return RunStatus(state, sentence.removeprefix(state).strip(), sentence)
    step_times = table.column("time_step_s")[1]
    patience = max(IDLE_AFTER_S, 10 * median(step_times)) if step_times else IDLE_AFTER_S
    of = f" of {planned_steps}" if planned_steps is not None else ""
    ago = f"metrics last written {fmt_duration(idle_s)} ago"
    if planned_steps is not None and last >= planned_steps:
        return RunStatus("finished", f"step {last}{of} reached")
    if table.partial_last_line or idle_s <= patience:
        going = pace(step_times, last, planned_steps)
        return RunStatus(
            "in progress", f"at step {last}{of}; {ago}" + (f"; {going.describe()}" if going else "")
        )
    if planned_steps is None:
        return RunStatus("finished or stopped", f"last step {last}, no config.yaml to compare with; {ago}")
    return RunStatus("stopped", f"at step {last}{of}; {ago}")


def fmt(value: float | None) -> str:
    """Four significant digits: enough to compare steps, short enough for a table."""
    return "n/a" if value is None else f"{value:.4g}"


def _reward_section(table: MetricsTable) -> list[str]:
    steps, rewards = table.column("reward_mean")
    if not rewards:
        return ["No `reward_mean` in the metrics."]
    best = max(range(len(rewards)), key=rewards.__getitem__)
    window = min(MEANS_WINDOW, len(rewards))
    return [
        "| reward_mean | step | value |",
        "|---|---:|---:|",
        f"| first | {steps[0]} | {fmt(rewards[0])} |",
        f"| last | {steps[-1]} | {fmt(rewards[-1])} |",
        f"| best | {steps[best]} | {fmt(rewards[best])} |",
        f"| mean of the first {window} | {steps[0]}..{steps[window - 1]} | {fmt(mean(rewards[:window]))} |",
        f"| mean of the last {window} | {steps[-window]}..{steps[-1]} | {fmt(mean(rewards[-window:]))} |",
    ]


def _time_section(table: MetricsTable) -> list[str]:
    step_times = table.column("time_step_s")[1]
    phases = table.time_phases()
    if not step_times and not phases:
        return ["No `time_*_s` keys in the metrics."]
    lines = []
    step_mean = mean(step_times)
    if step_mean is not None:
        recent = pace(step_times, 0, None)
        rate = f" ({recent.describe()} over the last {min(PACE_WINDOW, len(step_times))})" if recent else ""
        lines += [f"Mean step time: **{fmt(step_mean)} s** over {len(step_times)} steps{rate}.", ""]
    lines += ["| phase | mean s | share of step |", "|---|---:|---:|"]
    accounted = 0.0
    for phase in phases:
        # a phase missing on a step took no time there: average over every step, like time_step_s
        phase_mean = sum(table.column(f"time_{phase}_s")[1]) / len(table.rows)
        accounted += phase_mean
        lines.append(f"| {phase} | {fmt(phase_mean)} | {_percent(phase_mean, step_mean)} |")
    if step_mean is not None and step_mean - accounted > 0.005 * step_mean:
        other = step_mean - accounted
        lines.append(f"| other (not in a phase) | {fmt(other)} | {_percent(other, step_mean)} |")
    return lines


def _percent(part: float, whole: float | None) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "n/a"


def _sync_section(table: MetricsTable) -> list[str]:
    keys = [
        ("sync_gb_per_s", "throughput", "GB/s"),
        ("sync_transfer_s", "transfer", "s"),
        ("sync_control_s", "control", "s"),
        ("sync_pipeline_s", "pipeline", "s"),
        ("time_sync_s", "whole sync phase (with checks)", "s"),
    ]
    rows = [(label, unit, table.column(key)[1]) for key, label, unit in keys if table.has(key)]
    sizes = table.column("sync_bytes")[1]
    if not rows and not sizes:
        return ["No `sync_*` keys in the metrics."]
    lines = ["| sync | mean | min | max |", "|---|---:|---:|---:|"]
    if sizes:
        low, high, average = fmt_bytes(min(sizes)), fmt_bytes(max(sizes)), fmt_bytes(sum(sizes) / len(sizes))
        lines.append(f"| size | {average} | {low} | {high} |")
    for label, unit, values in rows:
        lines.append(f"| {label} ({unit}) | {fmt(mean(values))} | {fmt(min(values))} | {fmt(max(values))} |")
    return lines


def _eval_section(table: MetricsTable) -> list[str]:
    keys = table.keys_with_prefix(EVAL_PREFIX)
    lines = ["| eval | steps evaluated | first | last | best |", "|---|---:|---:|---:|---:|"]
    for key in keys:
        steps, values = table.column(key)
        lowest_best = "len" in key or "truncation" in key  # shorter, fewer truncations: not "better" per se
        best = (min if lowest_best else max)(range(len(values)), key=values.__getitem__)
        best_text = "" if lowest_best else f"{fmt(values[best])} (step {steps[best]})"
        lines.append(
            f"| {key} | {len(steps)} | {fmt(values[0])} (step {steps[0]}) | "
            f"{fmt(values[-1])} (step {steps[-1]}) | {best_text} |"
        )
    return lines


def render_summary(
    table: MetricsTable,
    run_dir: Path,
    status: RunStatus,
    plots: PlotResult,
    out_dir: Path,
    config_note: str | None = None,
    attempts: Sequence[Attempt] = (),
) -> str:
    """The whole `report.md`; image links are relative to `out_dir`, where the file is written."""
    steps = table.steps
    lines = [
        f"# Training report: `{run_dir}`",
        "",
        f"- metrics: `{table.path}`, {len(steps)} steps found ({steps[0]}..{steps[-1]})",
        f"- status: **{status.state}** " + (status.detail if status.sentence else f"({status.detail})"),
    ]
    if config_note:
        lines.append(f"- config: {config_note}")
    if attempts:  # what a resume cut or cleared, kept by the launcher (dsv4rl.faults.attempts)
        lines += ["", "## Earlier attempts", "", *(f"- {a.line()} (`{a.path}`)" for a in attempts)]
    lines += ["", "## Reward", "", *_reward_section(table)]
    lines += ["", "## Time per step", "", *_time_section(table)]
    lines += ["", "## Weight sync", "", *_sync_section(table)]
    if table.keys_with_prefix(EVAL_PREFIX):
        lines += ["", "## Evaluation", "", *_eval_section(table)]
    evals = collect_evals(run_dir)
    if evals:  # the periodic evals' reports next to every `dsv4rl eval` of the run's checkpoints
        lines += ["", "## Eval reports", "", *evals_section(evals, run_dir)]
    saved = rollouts_section(run_dir, out_dir)
    if saved:
        lines += ["", "## Rollouts", "", *saved]
    lines += ["", "## Plots", ""]
    for name, path in plots.written.items():
        link = path.relative_to(out_dir) if path.is_relative_to(out_dir) else path
        lines += [f"### {name}", "", f"![{name}]({link.as_posix()})", ""]
    if plots.skipped:
        lines += ["Skipped plots:", ""]
        lines += [f"- `{name}`: {why}" for name, why in plots.skipped.items()]
        lines.append("")
    if table.notes:
        lines += ["## Lines skipped in metrics.jsonl", ""]
        lines += [f"- {note}" for note in table.notes]
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"
