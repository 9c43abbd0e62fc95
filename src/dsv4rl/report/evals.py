"""A run's eval scores side by side: the periodic evals training ran (`<run>/eval/step_N.json`) next to
every `dsv4rl eval` of the run (`<run>/eval/<set>/eval.json`, scoring the model the run started from, and
`<run>/eval/<set>/step_N/eval.json`, scoring its checkpoint of step N). Read as plain JSON: a report
must also work on files an older dsv4rl wrote (those without `weights` say so)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_STEP_FILE = re.compile(r"^step_(\d+)\.json$")
_STEP_DIR = re.compile(r"^step_(\d+)$")
REPORT_FILE = "eval.json"


@dataclass(frozen=True)
class EvalRow:
    source: str  # "training" (periodic) or "dsv4rl eval"
    eval_set: str
    step: int | None  # the weights' training step (None: the run's starting model, or unknown)
    weights: str
    scores: dict[str, float]  # pass@1, avg@n, maj@n
    path: Path


def _scores(report: dict[str, Any]) -> dict[str, float]:
    keys = [k for k in report if k == "pass@1" or k.startswith(("avg@", "maj@"))]
    return {k: report[k] for k in keys if isinstance(report[k], int | float)}


def _weights(report: dict[str, Any], fallback_step: int | None, source: str) -> tuple[int | None, str]:
    weights = report.get("weights") or {}
    kind = weights.get("kind") or ("training" if source == "training" else None)
    if kind == "training":  # a periodic eval (older ones did not record it: the file names the step)
        step = weights.get("step", fallback_step)
        return step, f"training weights at step {step}"
    if kind == "checkpoint":
        return weights.get("step"), f"checkpoint step {weights.get('step')}"
    if kind == "tiny_model":
        return None, "starting model (tiny, from its seed)"
    if kind == "model_path":
        return None, f"model.path {weights.get('model_path')}"
    if kind == "responses":
        return None, "saved responses"
    return fallback_step, "not recorded"


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def collect_evals(run_dir: str | Path) -> list[EvalRow]:
    """Every eval report under `<run_dir>/eval`, by step (the starting model's first)."""
    root = Path(run_dir) / "eval"
    if not root.is_dir():
        return []
    found: list[tuple[str, Path, int | None]] = []
    for path in root.iterdir():
        periodic = _STEP_FILE.match(path.name)
        if periodic and path.is_file():
            found.append(("training", path, int(periodic.group(1))))
        elif path.is_dir():
            if (path / REPORT_FILE).is_file():
                found.append(("dsv4rl eval", path / REPORT_FILE, None))
            for sub in path.iterdir():
                match = _STEP_DIR.match(sub.name)
                if match and (sub / REPORT_FILE).is_file():
                    found.append(("dsv4rl eval", sub / REPORT_FILE, int(match.group(1))))
    rows = []
    for source, path, step in found:
        report = _read(path)
        if report is None or "pass@1" not in report:
            continue
        weights_step, weights = _weights(report, step, source)
        eval_set = str(report.get("eval", path.parent.name))
        if report.get("scored_by") == "recipe":  # `dsv4rl eval` without a set: the recipe's own reward
            eval_set += " (recipe's reward)"
        rows.append(EvalRow(source, eval_set, weights_step, weights, _scores(report), path))
    return sorted(rows, key=lambda r: (-1 if r.step is None else r.step, r.source != "training", r.eval_set))


def evals_section(rows: list[EvalRow], run_dir: Path) -> list[str]:
    """report.md's table: one row per eval, the periodic ones and `dsv4rl eval`'s of checkpoints."""
    keys = sorted({k for r in rows for k in r.scores}, key=lambda k: (k != "pass@1", k))
    lines = [
        "| step | eval set | by | weights | " + " | ".join(keys) + " | report |",
        "|---:|---|---|---|" + "---:|" * len(keys) + "---|",
    ]
    for row in rows:
        values = " | ".join(f"{row.scores[k]:.4f}" if k in row.scores else "" for k in keys)
        where = row.path.relative_to(run_dir) if row.path.is_relative_to(run_dir) else row.path
        step = "start" if row.step is None else str(row.step)
        lines.append(f"| {step} | {row.eval_set} | {row.source} | {row.weights} | {values} | `{where}` |")
    return lines
