"""The run's outcome in its trackers, recorded by the launcher once every process has ended: only it
knows whether the run finished, stopped or failed, and the failure's root cause (`dsv4rl.launcher`)."""

from __future__ import annotations

from pathlib import Path

from dsv4rl.config.choices import LoggerKind
from dsv4rl.config.schema import Config
from dsv4rl.metrics import read_metrics
from dsv4rl.trackers.hub import open_trackers
from dsv4rl.trackers.state import TENSORBOARD_DIR, read_state
from dsv4rl.trackers.wandb_log import sync_command


def last_step(run_dir: Path) -> int:
    """The last step metrics.jsonl holds (0 when none, or when a crash left its last line cut short)."""
    try:
        lines = read_metrics(run_dir / "metrics.jsonl")
        return int(lines[-1]["step"]) if lines else 0
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def record_outcome(cfg: Config, run_dir: str | Path, outcome: str, root_cause: str | None) -> list[str]:
    """Write `outcome` (finished, stopped, failed, hung, interrupted) and the root cause to each tracker
    of the run; returns the lines to show the user (where the trackers are, how to upload an offline W&B
    run). Nothing when the run logged to metrics.jsonl alone or its trainer never opened a tracker."""
    run_dir = Path(run_dir)
    listed = [kind for kind in cfg.logger if kind != LoggerKind.jsonl]
    state = read_state(run_dir)
    if not listed or state is None:
        return []
    trackers = open_trackers(cfg, run_dir, state.to_dict(), with_history=False)
    try:
        trackers.log_outcome(outcome, root_cause, last_step(run_dir))
    finally:
        trackers.close()
    lines = []
    if LoggerKind.tensorboard in listed:
        lines.append(f"TensorBoard: tensorboard --logdir {run_dir / TENSORBOARD_DIR}")
    if LoggerKind.wandb in listed:
        if state.wandb_mode == "offline":
            lines.append(f"W&B (offline): upload with `{sync_command(run_dir, state.wandb_id)}`")
        else:
            lines.append(f"W&B run id {state.wandb_id} ({state.wandb_mode})")
    return lines
