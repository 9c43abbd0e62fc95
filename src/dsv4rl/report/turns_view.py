"""A multi-turn rollout record's turns as rich table rows (`dsv4rl rollouts`): what the model wrote in each
turn, its tool calls with their results, and the inserted spans marked `[inserted: ...]` (dim): the tokens
with loss mask 0, which the model did not write and is not trained on. A call whose tool raised (or an
environment step that raised) shows the exception and the end of its traceback (`--json` has it whole)."""

from __future__ import annotations

from typing import Any

from rich.markup import escape
from rich.table import Table

FRAME_LINES = 2  # what is shown of a traceback: the frame that raised (its file and line, its code)


def _exception_rows(table: Table, exception: Any, width: int) -> None:
    """The exception a tool or an environment raised: its type and message, the end of its traceback."""
    if not isinstance(exception, dict):
        return
    head = f"{exception.get('type')}: {exception.get('message')}"
    table.add_row("  raised", f"[red]{escape(head[:width])}[/]")
    lines = str(exception.get("traceback") or "").rstrip().splitlines()
    frame = "\n".join(line[:width] for line in lines[-FRAME_LINES - 1 : -1])  # the last line is `head`
    if frame:
        table.add_row("", f"[dim]{escape(frame)}[/]")


def _call_line(call: dict[str, Any], width: int) -> str:
    status = []
    if call.get("malformed"):
        status.append("[red]malformed[/]")
    if call.get("exception") and not call.get("timed_out"):
        status.append("[red]the tool raised[/]")
    elif call.get("timed_out"):
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
            if call.get("exception") and not call.get("timed_out"):
                _exception_rows(table, call["exception"], width)
        _exception_rows(table, turn.get("exception"), width)  # the environment's step raised
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
    if record.get("tool_exceptions"):
        parts.append(f"{record['tool_exceptions']} raised by the tool or environment")
    return " · ".join(parts)
