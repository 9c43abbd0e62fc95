"""The multi-turn part of a rollout record (`run.save_rollouts` with `rollout.mode` tools / env).

A trajectory's response interleaves the model's tokens with what the template inserted (tool results, the
next turn's opening); only the model's are trained. The record says which is which, so `dsv4rl rollouts`
can show each turn with its inserted span marked and a reader can check the loss mask against the text:

- `turns`: per assistant turn its token span (`start`, `end`: the model's; `end`..`inserted_end`: inserted),
  the model's `text`, the `inserted` text, the engine's `finish_reason`, its `calls` (name, arguments,
  result, error, timed_out, time_s, ...; `exception: {type, message, traceback}` where the tool raised or
  ran past its timeout_s) and the `reward` the tools or the environment gave it (`exception` on the turn:
  the environment's step raised);
- `loss_mask`: the mask as runs `[start, end, mask]` over `response_ids` (a few runs instead of one float
  per token);
- `tool_calls`, `tool_errors`, `tool_timeouts`, `parse_errors`, `tool_exceptions`: the trajectory's counts
  (`tool_exceptions`: calls whose tool raised, environment steps that raised).

Texts are decoded from the ids when the caller passes `decode` (exact, template tokens included); without
it they come from the conversation's messages (what the turn said and what answered it).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from dsv4rl.report.rollouts import TRAJECTORY_FIELDS
from dsv4rl.samples import Sample, Trajectory

Decode = Callable[[list[int]], str]
__all__ = ["TRAJECTORY_FIELDS", "Decode", "mask_runs", "trajectory_fields"]


def mask_runs(mask: Sequence[float]) -> list[list[float | int]]:
    """`[start, end, value]` runs of equal mask values, in order (`end` exclusive)."""
    runs: list[list[float | int]] = []
    for index, value in enumerate(mask):
        if runs and runs[-1][2] == value and runs[-1][1] == index:
            runs[-1][1] = index + 1
        else:
            runs.append([index, index + 1, float(value)])
    return runs


def _json_safe(value: Any) -> Any:
    """A call record as JSON would store it (a tool's odd value becomes its str, never a failed write)."""
    return json.loads(json.dumps(value, ensure_ascii=False, default=str))


def _message_text(message: dict[str, Any]) -> str:
    parts = []
    if message.get("reasoning_content"):
        parts.append(f"<think>{message['reasoning_content']}</think>")
    if message.get("content"):
        parts.append(str(message["content"]))  # the turn's calls are in its record's `calls`
    return (
        "".join(parts) if message.get("role") == "assistant" else f"[{message.get('role')}] " + "".join(parts)
    )


def _texts_from_messages(trajectory: Trajectory) -> list[tuple[str, str]]:
    """(the model's text, what answered it) per turn, from the conversation (no tokenizer at hand)."""
    out: list[tuple[str, list[str]]] = []
    for message in trajectory.messages:
        if message.get("role") == "assistant":
            out.append((_message_text(message), []))
        elif out:
            out[-1][1].append(_message_text(message))
    return [(text, "\n".join(inserted)) for text, inserted in out]


def trajectory_fields(sample: Sample, decode: Decode | None = None) -> dict[str, Any]:
    """The multi-turn keys of `sample`'s record; {} for a single-turn sample (its record is unchanged)."""
    trajectory = sample.trajectory
    if trajectory is None:
        return {}
    ids = sample.response_ids
    fallback = _texts_from_messages(trajectory) if decode is None else []
    turns = []
    for index, turn in enumerate(trajectory.turns):
        if decode is not None:
            text, inserted = decode(ids[turn.start : turn.end]), decode(ids[turn.end : turn.inserted_end])
        else:
            text, inserted = fallback[index] if index < len(fallback) else ("", "")
            if turn.inserted_end == turn.end:
                inserted = ""  # the conversation's last answer was never inserted (the trajectory ended)
        turns.append(
            {
                "start": turn.start,
                "end": turn.end,
                "inserted_end": turn.inserted_end,
                "text": text,
                "inserted": inserted,
                "finish_reason": turn.finish_reason,
                "calls": _json_safe(turn.calls),
                "reward": turn.reward,
                **({"exception": _json_safe(turn.exception)} if turn.exception is not None else {}),
            }
        )
    mask = sample.loss_mask if sample.loss_mask is not None else [1.0] * len(ids)
    return {
        "turns": turns,
        "loss_mask": mask_runs(mask),
        "tool_calls": trajectory.tool_calls,
        "tool_errors": trajectory.tool_errors,
        "tool_timeouts": trajectory.tool_timeouts,
        "parse_errors": trajectory.parse_errors,
        "tool_exceptions": trajectory.tool_exceptions,
    }
