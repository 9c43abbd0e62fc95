"""The eval report as rich tables: the headline scores, then the problems one by one."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from dsv4rl.eval.weights import describe_weights

PROBLEM_ROWS = 40  # the rest stays in the JSON report


def headline_keys(report: dict[str, Any]) -> list[str]:
    """pass@k in k order, then avg@n and maj@n."""
    passes = sorted((k for k in report if k.startswith("pass@")), key=lambda k: int(k.split("@")[1]))
    return passes + [k for k in report if k.startswith(("avg@", "maj@"))]


def render_eval(report: dict[str, Any], console: Console, report_path: str | None = None) -> None:
    scores = Table(
        title=f"eval {report['eval']}: {report['problems']} problems x {report['samples_per_problem']}"
    )
    scores.add_column("score", style="cyan")
    scores.add_column("value", justify="right")
    for key in headline_keys(report):
        scores.add_row(key, f"{report[key]:.4f}")
    numbers = (
        ("truncation_ratio", "truncated"),
        ("response_len_mean", "mean response tokens"),
        ("no_answer_fraction", "thinking never closed (no answer)"),  # chat_format=deepseek_v4's split
        ("reasoning_len_mean", "mean reasoning tokens"),
        ("answer_len_mean", "mean answer tokens"),
        ("calls_per_problem", "mean tool calls per sample"),  # rollout.mode tools / env (eval.tools)
        ("turns_mean", "mean assistant turns"),
        ("tool_errors_mean", "mean failed tool calls"),
        ("tool_timeouts_mean", "mean timed-out tool calls"),
        ("parse_errors_mean", "mean malformed calls"),
    )
    for key, label in numbers:
        if report.get(key) is not None:
            scores.add_row(label, f"{report[key]:.4g}")
    finishes = {k.removeprefix("finish/"): v for k, v in report.items() if k.startswith("finish/") and v}
    if finishes:
        scores.add_row("finish reasons", ", ".join(f"{k} {v:.0%}" for k, v in finishes.items()))
    console.print(scores)
    rows = report["per_problem"]
    table = Table(title=f"per problem ({min(len(rows), PROBLEM_ROWS)} of {len(rows)})")
    for column in ("id", "answer", "correct", "majority answer"):
        table.add_column(column)
    for row in rows[:PROBLEM_ROWS]:
        majority = row["majority_answer"] if row["majority_answer"] is not None else "-"
        mark = "[green]✓[/green]" if row["majority_correct"] else "[red]✗[/red]"
        table.add_row(
            str(row["id"]), row["answer"], f"{row['correct']}/{row['samples']}", f"{majority:.30} {mark}"
        )
    console.print(table)
    sampling = report["sampling"]
    timing = ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in report["seconds"].items())
    how = (
        f"temperature {sampling['temperature']:g}, top-p {sampling['top_p']:g}, "
        f"cap {sampling['max_new_tokens']} tokens"
        if sampling is not None
        else f"saved responses ({report.get('responses_file')})"
    )
    scored_by = report.get("scored_by", "eval_set")
    if scored_by == "recipe":
        graded = f"scored by the recipe's {report['grader']}; pass at reward >= {report['pass_reward']:g}"
    else:
        graded = f"scored by the eval set's grader {report['grader']}"
    console.print(f"{graded}, {how}; {timing}", soft_wrap=True)
    mean = next((report[k] for k in report if k.startswith("avg@")), 0.0)
    if scored_by == "recipe" and report.get("pass@1") == 0 and mean > 0:  # rewarded, yet nothing passes
        console.print(
            f"[yellow]no response reached reward {report['pass_reward']:g} (mean reward {mean:.4g}): a "
            "function that never gives its full 1.0, or a penalty, keeps the total below the weight sum; "
            "set eval.pass_reward to the total that counts as correct[/yellow]",
            soft_wrap=True,
        )
    console.print(f"weights: {describe_weights(report.get('weights'))}", soft_wrap=True)
    grading = report.get("grading") or {}
    if grading.get("timeouts") or grading.get("errors"):
        types = ", ".join(f"{kind} x{count}" for kind, count in grading.get("error_types", {}).items())
        console.print(
            f"[yellow]grading: {grading['timeouts']} response(s) timed out, {grading['errors']} raised"
            f"{f' ({types})' if types else ''}, {grading.get('restarts', 0)} pool restart(s); all graded "
            "incorrect[/yellow]"
        )
    if report.get("unknown_ids"):
        ids = [u["id"] for u in report["unknown_ids"]]
        console.print(
            f"[yellow]{len(ids)} response line(s) with ids not in the eval set: {ids[:10]}[/yellow]"
        )
    if report.get("missing"):
        console.print(
            f"[yellow]{len(report['missing'])} problem(s) without responses: "
            f"{report['missing'][:10]}[/yellow]"
        )
    if report_path:
        console.print(f"report: {report_path}")
