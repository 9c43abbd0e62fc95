"""The `dsv4rl align` report as rich tables: the distribution of |trainer - engine| and the worst tokens."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def render_align(report: dict, console: Console) -> None:
    summary = Table(title=f"|trainer - engine| log-prob, quant={report['quant']}", show_header=False)
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
