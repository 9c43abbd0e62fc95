"""`dsv4rl prompts`: what the model will see. The first N prompts of the recipe's training data as
rendered and tokenized for the engines, and the prompt-length distribution of the whole data set with
how many rows `data.max_prompt_len` leaves out. With tools (`rollout.mode` tools / env) the prompts are
rendered as training renders them, by `build_multi_turn`'s renderer: with deepseek_v4 every prompt carries
the tools' block (which counts against `max_prompt_len`); chat_format none has no block, the tools are
listed beside the prompts.
"""

from __future__ import annotations

import re
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dsv4rl.config.schema import Config
from dsv4rl.data.chat_format import PromptRenderer
from dsv4rl.data.datasets import problem_source
from dsv4rl.data.stream import encode_problems

PERCENTILES = (50, 90, 99)


def length_summary(lengths: list[int]) -> dict[str, float | int]:
    """count, min, mean, p50/p90/p99 (nearest rank) and max of prompt lengths in tokens."""
    ordered = sorted(lengths)
    n = len(ordered)
    summary: dict[str, float | int] = {"count": n, "min": ordered[0], "mean": sum(ordered) / n}
    for p in PERCENTILES:
        summary[f"p{p}"] = ordered[min(n - 1, max(0, -(-p * n // 100) - 1))]
    summary["max"] = ordered[-1]
    return summary


def prompt_report(cfg: Config, renderer: PromptRenderer, n: int, tokenizer_name: str) -> dict[str, Any]:
    """{"prompts": [{"id", "text", "ids", "tokens"}], "lengths": {...}, "dropped": N} for the recipe's
    training prompts (after `data.holdout`), in data-set order, rendered by `renderer` (a multi-turn
    recipe's carries its tools); `tokenizer_name` says which tokenizer was used. `rollout_mode` and
    `tools` (the schemas the prompts carry) say what a multi-turn recipe adds."""
    problems = problem_source(cfg.data, cfg.seed)
    encoded = encode_problems(problems, renderer, cfg.data.max_prompt_len)
    first = [problems[i] for i in range(min(n, len(problems)))]
    prompts = []
    for problem, ids in zip(first, renderer.encode([p.prompt for p in first]), strict=True):
        prompts.append(
            {"id": problem.id, "text": renderer.render(problem.prompt), "ids": ids, "tokens": len(ids)}
        )
    settings = renderer.settings
    return {
        "prompts": prompts,
        "lengths": {**length_summary(encoded.lengths), "max_prompt_len": cfg.data.max_prompt_len},
        "dropped": encoded.dropped,
        "data": cfg.data.name,
        "chat_format": settings.format.value,
        "thinking": settings.thinking,
        "reasoning_effort": settings.reasoning_effort.value if settings.reasoning_effort else None,
        "reasoning_budget": settings.reasoning_budget,
        "effort_line": effort_line(prompts[0]["text"]) if prompts else None,
        "tokenizer": tokenizer_name,
        "rollout_mode": cfg.rollout.mode.value,
        "tools": [dict(schema) for schema in renderer.tools],
    }


def effort_line(text: str, words: int = 6) -> str | None:
    """The first words of the prompt's "Reasoning Effort:" line, None without one: what a tier renders
    depends on the encoder (deepseek-recipe 0.2.0's `low` writes none, its `high` "Absolute maximum ..."),
    so the text is shown beside the tier's name (docs/reference_run.md)."""
    match = re.search(r"Reasoning Effort:[^\n]*", text)
    return " ".join(match.group(0).split()[:words]) + " ..." if match else None


def render_prompts(report: dict[str, Any], console: Console) -> None:
    """The report as two rich tables: the first prompts, then the length distribution."""
    effort = ""
    if report["chat_format"] != "none" and report["thinking"]:
        line = report.get("effort_line")
        budget = report.get("reasoning_budget")
        setting = (
            f"reasoning_budget={budget}"
            if budget is not None
            else f"reasoning_effort={report['reasoning_effort']}"
        )
        effort = f", {setting} ({line or 'no effort line'})"
    title = (
        f"{report['data']}: chat_format={report['chat_format']}, thinking={str(report['thinking']).lower()}"
        f"{effort}, tokenizer {report['tokenizer']}"
    )
    prompts = Table(title=title, show_lines=True)
    prompts.add_column("id", no_wrap=True)
    prompts.add_column("tokens", justify="right")
    prompts.add_column("prompt as the model sees it")
    for row in report["prompts"]:
        prompts.add_row(escape(str(row["id"])), str(row["tokens"]), escape(row["text"]))
    console.print(prompts)
    _print_tools(report, console)
    lengths = report["lengths"]
    table = Table(title="prompt length in tokens, whole data set")
    keys = ["count", "min", "mean", *(f"p{p}" for p in PERCENTILES), "max", "max_prompt_len"]
    for key in [*keys, "dropped"]:
        table.add_column(key, justify="right")
    cells = [f"{lengths[k]:.1f}" if isinstance(lengths[k], float) else str(lengths[k]) for k in keys]
    table.add_row(*cells, str(report["dropped"]))
    console.print(table)


def _print_tools(report: dict[str, Any], console: Console) -> None:
    """The tools a multi-turn recipe gives the model (deepseek_v4: also in the prompts' block above)."""
    tools = report.get("tools") or []
    if not tools:
        return
    where = (
        "in every prompt's tool block above"
        if report["chat_format"] != "none"
        else "called with the plain syntax `argument?` (chat_format none: no block in the prompt)"
    )
    console.print(f"rollout.mode={report.get('rollout_mode')}: {len(tools)} tool(s), {where}")
    for schema in tools:
        console.print(f"  {escape(str(schema.get('name')))}: {escape(str(schema.get('description', '')))}")
