"""Which weights an eval scored, recorded in every eval report (`weights`): a checkpoint of a run and its
step (an export `dsv4rl eval ... checkpoint=` made, named by its `dsv4rl-export.json`), a model
directory (`model.path`), the tiny model built from its seed, or a training run's own weights at a step
(the periodic eval)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

EXPORT_FILE = "dsv4rl-export.json"  # written by `dsv4rl export` beside the weights


def export_record(model_dir: str | Path) -> dict[str, Any] | None:
    path = Path(model_dir) / EXPORT_FILE
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None


def scored_weights(model_path: str | None, run_dir: str | Path) -> dict[str, Any]:
    """`weights` of a `dsv4rl eval` report: what the engines served."""
    if model_path is None:
        return {
            "kind": "tiny_model",
            "model_path": str(Path(run_dir) / "model"),
            "checkpoint": None,
            "step": None,
        }
    record = export_record(model_path)
    if record is None:
        return {"kind": "model_path", "model_path": str(model_path), "checkpoint": None, "step": None}
    return {
        "kind": "checkpoint",
        "model_path": str(model_path),
        "run": record.get("run"),
        "checkpoint": record.get("checkpoint"),
        "step": record.get("step"),
        "quant": record.get("quant"),
    }


def training_weights(run_dir: str | Path, step: int) -> dict[str, Any]:
    """`weights` of a periodic eval: the run's policy after `step` (the engines just received it)."""
    return {"kind": "training", "run": str(Path(run_dir).resolve()), "step": step, "checkpoint": None}


def describe_weights(weights: dict[str, Any] | None) -> str:
    if not weights:
        return "not recorded"
    kind = weights.get("kind")
    if kind == "checkpoint":
        return f"checkpoint step {weights['step']} of {weights['run']} (exported to {weights['model_path']})"
    if kind == "training":
        return f"the training run's weights after step {weights['step']}"
    if kind == "tiny_model":
        return f"the tiny model built from its seed ({weights['model_path']}), untrained"
    if kind == "responses":
        return f"saved responses ({weights.get('responses_file')})"
    return f"model.path {weights.get('model_path')}"
