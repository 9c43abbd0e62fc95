"""TensorBoard: event files under `<run.dir>/tensorboard`, through torch's SummaryWriter.

Scalars are written in TensorBoard's tensor form at double precision (`double_precision=True`), so a
value read back equals metrics.jsonl's exactly. The global step is the training step; a resumed run
purges the events of steps after its checkpoint (`purge_step`), as metrics.jsonl drops their lines.
TensorBoard shows them with `tensorboard --logdir <run.dir>/tensorboard`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

from dsv4rl.trackers.state import TENSORBOARD_DIR


def scalar_items(metrics: Mapping[str, object]) -> list[tuple[str, float]]:
    """The numeric entries of a step's metrics (strings, lists and missing values are not scalars)."""
    out = []
    for key, value in metrics.items():
        if isinstance(value, int | float):  # bools too (an int)
            out.append((key, float(value)))
    return out


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, run_dir: str | Path, resume_step: int | None = 0) -> None:
        """`resume_step`: the step the run (re)starts after; its writer marks a session start there, so
        TensorBoard drops earlier files' events of later steps (its reader takes only a second start as
        a restart: every writer marks one). None: append without a mark (the launcher's outcome)."""
        from torch.utils.tensorboard import SummaryWriter

        self.directory = Path(run_dir) / TENSORBOARD_DIR
        purge = resume_step + 1 if resume_step is not None else None
        self.writer = SummaryWriter(log_dir=str(self.directory), purge_step=purge, flush_secs=10)
        self.step = resume_step or 0

    def log_config(self, config: Mapping[str, object]) -> None:
        self.writer.add_text("config", _code_block(json.dumps(config, indent=2, default=str)), 0)

    def log_plan(self, plan: Mapping[str, object]) -> None:
        self.writer.add_text("plan", _code_block(json.dumps(plan, indent=2, default=str)), 0)

    def log_step(self, step: int, metrics: Mapping[str, object]) -> None:
        for key, value in scalar_items(metrics):
            if key == "step" or math.isnan(value):  # NaN: no point to plot
                continue
            self.writer.add_scalar(key, value, global_step=step, new_style=True, double_precision=True)
        self.step = step

    def log_outcome(self, outcome: str, root_cause: str | None, step: int) -> None:
        text = outcome if not root_cause else f"{outcome}: {root_cause}"
        self.writer.add_text("outcome", text, step)
        self.step = max(self.step, step)

    def close(self) -> None:
        self.writer.close()


def _code_block(text: str) -> str:
    """TensorBoard renders text as markdown: indent it to keep it verbatim."""
    return "\n".join("    " + line for line in text.splitlines())
