"""Where checkpoints live and which are complete: what the launcher checks before a run, without torch.

A checkpoint whose weights were checked finite before it was written says so in its `trainer_state.pt`
(`FINITE`: True; `dsv4rl.train.nonfinite` refuses to write non-finite weights at all). Pruning keeps the
newest such checkpoint even when it is older than the newest `keep`, so that a run can always go back to
weights known to be finite; a checkpoint without the mark (written before the check existed, or
unreadable) is not known to be finite.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

STEP_DIR = re.compile(r"^step_(\d+)$")
TRAINER_STATE = "trainer_state.pt"
FINITE = "finite"  # trainer_state.pt's mark: the weights were checked finite before the save

log = logging.getLogger(__name__)


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


def complete_checkpoints(root: str | Path) -> list[Path]:
    """The complete `step_N` checkpoints under `root`, newest first."""
    return [path for _, path in reversed(_complete_checkpoints(Path(root)))]


def latest_checkpoint(root: str | Path) -> Path | None:
    """The complete `step_N` checkpoint with the highest N under `root`, or None."""
    found = _complete_checkpoints(Path(root))
    return found[-1][1] if found else None


def marked_finite(checkpoint: str | Path) -> bool:
    """Whether the checkpoint's `trainer_state.pt` says its weights were checked finite (torch, imported
    here only: the launcher never prunes)."""
    import torch

    try:
        state = torch.load(Path(checkpoint) / TRAINER_STATE, weights_only=True)
    except Exception:  # unreadable or truncated: not known to be finite
        return False
    return isinstance(state, dict) and state.get(FINITE) is True


def prune_checkpoints(root: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints (keep <= 0: delete nothing), except the
    newest one marked finite (`marked_finite`), which is never deleted."""
    if keep <= 0:
        return []
    found = [path for _, path in _complete_checkpoints(Path(root))]
    removed = found[:-keep]
    if removed and not any(marked_finite(path) for path in found[-keep:]):
        finite = next((path for path in reversed(removed) if marked_finite(path)), None)
        if finite is not None:
            removed.remove(finite)
            log.warning("kept %s: none of the newest %d checkpoints is marked finite", finite, keep)
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed
