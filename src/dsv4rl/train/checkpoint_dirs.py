"""Where checkpoints live and which are complete: what the launcher checks before a run, without torch."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

STEP_DIR = re.compile(r"^step_(\d+)$")
TRAINER_STATE = "trainer_state.pt"


def checkpoint_dir(root: str | Path, step: int) -> Path:
    """Where the checkpoint of `step` lives under `root` (the name `latest_checkpoint` looks for)."""
    return Path(root) / f"step_{step:08d}"


def _complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = STEP_DIR.match(child.name)
        if match and child.is_dir() and (child / TRAINER_STATE).exists():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The complete `step_N` checkpoint with the highest N under `root`, or None."""
    found = _complete_checkpoints(Path(root))
    return found[-1][1] if found else None


def prune_checkpoints(root: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints (keep <= 0: delete nothing)."""
    if keep <= 0:
        return []
    removed = [path for _, path in _complete_checkpoints(Path(root))[:-keep]]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed
