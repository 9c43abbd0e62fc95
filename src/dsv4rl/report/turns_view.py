"""A multi-turn rollout record's turns as rich table rows (`dsv4rl rollouts`): what the model wrote in each
turn, its tool calls with their results, and the inserted spans marked `[inserted: ...]` (dim): the tokens
with loss mask 0, which the model did not write and is not trained on."""

from __future__ import annotations

from typing import Any

from rich.markup import escape
from rich.table import Table


def _call_line(call: dict[str, Any], width: int) -> str:
    status = []
    if call.get("malformed"):
        status.append("[red]malformed[/]")
    if call.get("timed_out"):
        status.append("[red]timed out[/]")
    elif call.get("error"):
        status.append("[red]error[/]")
    seconds = call.get("time_s")
    if isinstance(seconds, (int, float)):
        status.append(f"{seconds:.2f} s")
    head = f"{escape(str(call.get('name')))}({escape(str(call.get('arguments', ''))[:width])})"
    result = escape(str(call.get("result", ""))[:width])
    return f"{head} → {result}" + (f" ({', '.join(status)})" if status else "")


def add_turn_rows(table: Table, record: dict[str, Any], width: int) -> None:
    """One row per turn (and per call); the table has two columns (label, text)."""
    for number, turn in enumerate(record.get("turns") or [], start=1):
        label = f"turn {number}"
        extra = [str(turn.get("finish_reason"))]
        if turn.get("reward") is not None:
            extra.append(f"reward {turn['reward']:.3g}")
        text = escape(str(turn.get("text", ""))[:width])
        table.add_row(f"{label} ({', '.join(extra)})", text or "[dim](empty)[/]")
        for call in turn.get("calls") or []:
            table.add_row("  call", _call_line(call, width))
        inserted = turn.get("inserted") or ""
        if inserted or turn.get("inserted_end", 0) > turn.get("end", 0):
            tokens = turn.get("inserted_end", 0) - turn.get("end", 0)
            table.add_row("", f"[dim]\\[inserted, {tokens} tokens masked: {escape(inserted[:width])}][/]")


def turns_summary(record: dict[str, Any]) -> str:
    """`3 turns · 2 calls · 41 masked tokens` for a multi-turn record; "" otherwise."""
    turns = record.get("turns")
    if not turns:
        return ""
    masked = sum(end - start for start, end, value in record.get("loss_mask") or [] if not value)
    parts = [f"{len(turns)} turns", f"{record.get('tool_calls', 0)} calls", f"{masked} masked tokens"]
    errors = record.get("tool_errors", 0) + record.get("tool_timeouts", 0) + record.get("parse_errors", 0)
    if errors:
        parts.append(f"{errors} failed calls")
    return " · ".join(parts)
