"""Rollout records: what the model wrote at a step and what each reward function made of it.

With `run.save_rollouts: N` the trainer writes every N-th step's samples to
`<run.dir>/rollouts/step_<step, 8 digits>.jsonl`, one JSON object per sample (`FIELDS`).
`dsv4rl rollouts RUN_DIR [--step N] [--n K] [--sort reward|length] [--json]` reads them back: the best and
the worst samples of a step (by total reward, or the longest and shortest), their prompt and response, and
each function's result; `dsv4rl report` lists the steps there are. A multi-turn record (`rollout.mode` tools /
env) also has `TRAJECTORY_FIELDS`; its response is shown turn by turn, inserted spans marked
(`dsv4rl.report.turns_view`).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from dsv4rl.config.choices import RolloutSort
from dsv4rl.faults.run_outcome import read_run_outcome
from dsv4rl.report.metrics_table import ReportError
from dsv4rl.report.turns_view import add_turn_rows, turns_summary

ROLLOUTS_DIR = "rollouts"
_STEP_FILE = re.compile(r"step_(\d+)\.jsonl")
# What each record holds (tests and docs/tasks.md list the same)
FIELDS = (
    "step", "index", "group", "problem_id", "prompt", "prompt_ids", "response", "reasoning", "answer",
    "response_ids", "logprobs", "finish_reason", "ground_truth", "rewards", "reward", "excluded", "trained",
    "advantage", "weight_version", "versions",
)  # fmt: skip
# What a multi-turn record adds (dsv4rl.train.trajectory_records)
TRAJECTORY_FIELDS = (
    "turns", "loss_mask", "tool_calls", "tool_errors", "tool_timeouts", "parse_errors", "tool_exceptions",
)  # fmt: skip


def rollouts_file(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / ROLLOUTS_DIR / f"step_{step:08d}.jsonl"


def saved_steps(run_dir: str | Path) -> list[int]:
    """The steps whose rollouts a run saved, in order."""
    folder = Path(run_dir) / ROLLOUTS_DIR
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for p in folder.iterdir() if (m := _STEP_FILE.fullmatch(p.name)))


def load_step(run_dir: str | Path, step: int | None = None) -> tuple[int, list[dict[str, Any]]]:
    """(step, its records): the given step, or the last one saved. ReportError naming what there is."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a directory; pass a run's directory (its run.dir)")
    steps = saved_steps(run_dir)
    if not steps:
        raise ReportError(
            f"{run_dir} has no rollout records ({run_dir / ROLLOUTS_DIR} is empty or missing): train with "
            "run.save_rollouts=N to save every N-th step's samples"
        )
    step = steps[-1] if step is None else step
    if step not in steps:
        near = ", ".join(str(s) for s in steps[-10:])
        raise ReportError(f"no rollouts saved for step {step} in {run_dir}; saved steps: {near}")
    records = []
    path = rollouts_file(run_dir, step)
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise ReportError(f"{path}, line {number}: not JSON ({error.msg})") from None
    return step, records


def run_end(run_dir: str | Path) -> str | None:
    """How the run ended when it did not finish ("crashed at step 12 (root cause: ...)"), from its
    OUTCOME record: the steps saved so far are then all there will be."""
    outcome = read_run_outcome(run_dir)
    return None if outcome is None or outcome.outcome == "finished" else outcome.sentence()


def select(records: list[dict[str, Any]], n: int, sort: RolloutSort) -> tuple[list[dict], list[dict]]:
    """(the best n, the worst n) by total reward, or (the longest n, the shortest n) by response length.
    Samples without a reward (excluded) sort last."""
    if sort == RolloutSort.length:
        ordered = sorted(records, key=lambda r: (-len(r.get("response_ids") or []), r.get("index", 0)))
    else:
        ordered = sorted(
            records, key=lambda r: (bool(r.get("excluded")), -(r.get("reward") or 0.0), r.get("index", 0))
        )
    n = max(0, min(n, len(ordered)))
    top = ordered[:n]
    rest = [r for r in ordered if r not in top]
    if sort == RolloutSort.reward:  # the worst scored samples; excluded ones only when nothing else is left
        rest = [r for r in rest if not r.get("excluded")] or rest
    bottom = list(reversed(rest[-n:])) if n else []
    return top, bottom


def _fn_cell(result: dict[str, Any]) -> str:
    score = result.get("score")
    text = "—" if score is None else f"{score:.3g}"
    if result.get("status") not in (None, "ok"):
        text += f" ({result['status']})"
    extras = result.get("extras") or {}
    if extras:
        text += " " + " ".join(f"{k}={v:.3g}" for k, v in list(extras.items())[:4])
    return text


def render_rollouts(step: int, top: list[dict], bottom: list[dict], sort: RolloutSort, console: Console,
                    total: int, width: int = 600) -> None:  # fmt: skip
    """The chosen samples of one step, each as a panel: prompt, response, per-function results."""
    best, worst = ("longest", "shortest") if sort == RolloutSort.length else ("best", "worst")
    console.print(f"[bold]step {step}[/]: {total} samples; the {len(top)} {best} and {len(bottom)} {worst}")
    for title, records in ((best, top), (worst, bottom)):
        for record in records:
            table = Table.grid(padding=(0, 1))
            table.add_column(style="bold")
            table.add_column()
            table.add_row("prompt", escape(str(record.get("prompt", ""))[:width]))
            if record.get("reasoning"):
                table.add_row("reasoning", escape(record["reasoning"][:width]))
            if record.get("turns"):
                table.add_row("trajectory", turns_summary(record))
                add_turn_rows(table, record, width)
            else:
                table.add_row("response", escape(str(record.get("response", ""))[:width]))
            table.add_row("reference", escape(str(record.get("ground_truth", ""))))
            for name, result in (record.get("rewards") or {}).items():
                table.add_row(f"  {name}", escape(_fn_cell(result)))
                if result.get("error"):
                    table.add_row("", f"[red]{escape(result['error'][:300])}[/]")
            reward = "excluded (no score)" if record.get("excluded") else f"{record.get('reward', 0.0):.4g}"
            advantage = record.get("advantage")
            adv = "not trained" if advantage is None else f"{advantage:+.3f}"
            tokens = len(record.get("response_ids") or [])
            subtitle = f"reward {reward} · advantage {adv} · {tokens} tokens · {record.get('finish_reason')}"
            console.print(
                Panel(
                    table,
                    title=f"{title}: sample {record.get('index')} (group {record.get('group')})",
                    subtitle=subtitle,
                    title_align="left",
                    subtitle_align="left",
                )  # fmt: skip
            )


def rollouts_section(run_dir: Path, out_dir: Path) -> list[str]:
    """report.md's list of the steps with saved rollouts, linked, and the command that shows one."""
    steps = saved_steps(run_dir)
    if not steps:
        return []
    lines = [
        f"{len(steps)} steps saved (run.save_rollouts): `dsv4rl rollouts {run_dir} --step N` shows one.",
        "",
    ]
    for step in steps:
        link = os.path.relpath(rollouts_file(run_dir, step).resolve(), Path(out_dir).resolve())
        lines.append(f"- [step {step}]({Path(link).as_posix()})")
    return lines
