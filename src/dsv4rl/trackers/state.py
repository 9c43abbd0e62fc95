"""What a resumed run needs to continue its tracker runs: the W&B run id and mode, the TensorBoard step.

Kept in `<run.dir>/trackers.json` (the launcher reads it to record the outcome) and in every checkpoint's
extra state (a resume continues from the checkpoint's, whatever the file says since).
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import asdict, dataclass, field
from pathlib import Path

STATE_FILE = "trackers.json"
TENSORBOARD_DIR = "tensorboard"


@dataclass
class TrackerState:
    wandb_id: str = field(default_factory=lambda: secrets.token_hex(4))
    wandb_mode: str | None = None  # "online" or "offline", as the run was first opened
    tensorboard_step: int = 0  # the last step written to the event files

    @classmethod
    def from_dict(cls, data: dict | None) -> TrackerState:
        if not data:
            return cls()
        known = {key: data[key] for key in ("wandb_id", "wandb_mode", "tensorboard_step") if key in data}
        return cls(**known)

    def to_dict(self) -> dict:
        return asdict(self)


def read_state(run_dir: str | Path) -> TrackerState | None:
    path = Path(run_dir) / STATE_FILE
    if not path.is_file():
        return None
    try:
        return TrackerState.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def write_state(run_dir: str | Path, state: TrackerState) -> None:
    """Atomically: the launcher may read it while the trainer writes."""
    path = Path(run_dir) / STATE_FILE
    partial = path.with_name(f".{STATE_FILE}.{os.getpid()}.tmp")
    partial.write_text(json.dumps(state.to_dict(), indent=2) + "\n")
    partial.replace(path)
