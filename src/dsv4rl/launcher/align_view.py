"""The `dsv4rl align` report as rich tables: the distribution of |trainer - engine| and the worst tokens."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table


def render_align(report: dict, console: Console) -> None:
    numerics = report.get("numerics", {}).get("engine", "exact")
    title = f"|trainer - engine| log-prob, quant={report['quant']}, engine.numerics={numerics}"
    summary = Table(title=title, show_header=False)
    summary.add_column(style="cyan")
    summary.add_column(justify="right")
    summary.add_row("tokens", str(report["tokens"]))
    for key in ("mean", "p50", "p95", "p99", "max"):
        summary.add_row(f"{key} |diff|", f"{report[f'{key}_abs_diff']:.3g}")
    summary.add_row("mean diff (trainer - engine)", f"{report['mean_diff']:+.3g}")
    summary.add_row("KL(engine || trainer), k3", f"{report['kl_k3']:.3g}")
    console.print(summary)
    console.print(
        f"{report['responses']} responses ({report['prompts']} prompts x {report['samples_per_prompt']}, "
        f"up to {report['max_new_tokens']} tokens, temperature {report['temperature']:g}) from "
        f"{len(report['engines'])} engine(s); weights synced: {report['sync']['bytes'] / 1e6:.2f} MB in "
        f"{report['sync']['buckets']} buckets, {report['sync']['seconds']:.2f} s"
    )
    if report["worst_tokens"]:
        worst = Table(title="largest differences", show_header=True)
        worst.add_column("|diff|", justify="right")
        worst.add_column("trainer", justify="right")
        worst.add_column("engine", justify="right")
        worst.add_column("context")
        worst.add_column("token")
        for row in report["worst_tokens"]:
            worst.add_row(
                f"{row['abs_diff']:.3g}",
                f"{row['trainer_logprob']:.3f}",
                f"{row['rollout_logprob']:.3f}",
                repr(row["context"][-40:]),
                repr(row["token"]),
            )
        console.print(worst)


def render_attribution(report: dict, console: Console) -> None:
    """`dsv4rl align --attribute`: baseline, aligned, and each feature alone and left out (one row each)."""
    title = (
        f"|trainer - engine| log-prob by alignment feature: {report['sequences']} sequences, "
        f"quant={report['quant']}, engine={report['engine']} (numerics={report['engine_numerics']})"
    )
    caption = (
        "alone: only this feature on (mean, p99, max |diff|; the share of the baseline's mean it closes); "
        "without: every feature but this (mean; what leaving it out costs)"
    )
    table = Table(title=title, caption=caption, box=box.SIMPLE_HEAD, padding=(0, 1), collapse_padding=True)
    table.add_column("feature", no_wrap=True)
    for column in ("alone", "p99", "max", "closed", "without", "cost"):
        table.add_column(column, justify="right", no_wrap=True)
    for label in ("baseline", "aligned"):
        row = report[label]
        numbers = [f"{row[k]:.2g}" for k in ("mean_abs_diff", "p99_abs_diff", "max_abs_diff")]
        table.add_row(f"{label} (all {'off' if label == 'baseline' else 'on'})", *numbers, "", "", "")
    for feature in report["features"]:
        table.add_row(
            feature["name"],
            *(f"{feature[f'{k}_abs_diff_alone']:.2g}" for k in ("mean", "p99", "max")),
            f"{100 * feature['gap_closed_alone']:.0f}%",
            f"{feature['mean_abs_diff_without']:.2g}",
            f"{feature['cost_without']:+.1g}",
        )
    console.print(table)
    reduction = report["reduction"]
    mean, p99 = reduction["mean"], reduction["p99"]
    console.print(
        f"aligned vs baseline: mean |diff| {'closed' if mean is None else f'{mean:.3g}x smaller'}, p99 "
        f"{'closed' if p99 is None else f'{p99:.3g}x smaller'} ({report['baseline']['tokens']} tokens, "
        f"temperature 1, {report['engine_starts']} engine start(s))"
    )
    for name, why in report.get("skipped_features", {}).items():
        console.print(f"[dim]not attributed: {name}: {why}[/dim]")
    for label in ("baseline", "aligned"):
        worst = report[label].get("worst_tokens") or []
        if not worst:
            continue
        table = Table(title=f"largest differences, {label}", show_header=True)
        for column in ("|diff|", "trainer", "engine", "context", "token"):
            table.add_column(column, justify="right" if column in ("|diff|", "trainer", "engine") else "left")
        for row in worst:
            table.add_row(
                f"{row['abs_diff']:.3g}",
                f"{row['trainer_logprob']:.3f}",
                f"{row['rollout_logprob']:.3f}",
                repr(row["context"][-40:]),
                repr(row["token"]),
            )
        console.print(table)
