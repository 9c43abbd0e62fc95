"""The trainer's side of a graceful stop: every rank agrees, at the same step boundary, to stop.

A stop is asked for by a signal to any rank (`dsv4rl.faults.stop.StopSignals`) or by `<run_dir>/STOP`,
which only rank 0 reads. At each step boundary (after a step's weight sync and checkpoint, never in the
middle of a sync) the ranks all-reduce one flag, so all of them take the same branch: write the
checkpoint of the step just done, then leave the loop (`dsv4rl.train.loop`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist

from dsv4rl.faults.stop import StopSignals, read_stop_request

log = logging.getLogger(__name__)


class BoundaryStop:
    """`requested()` at each step boundary; `signals` is this rank's (None: only the STOP file)."""

    def __init__(
        self, run_dir: Path, rank: int, device: torch.device | None = None, signals: StopSignals | None = None
    ) -> None:
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.device = device or torch.device("cpu")
        self.signals = signals

    def _local(self) -> str | None:
        reason = self.signals.reason if self.signals is not None else None
        if reason is None and self.rank == 0:
            reason = read_stop_request(self.run_dir)
        return reason

    def requested(self) -> str | None:
        """Collective over the default group: why to stop (this rank's reason, or that another rank was
        asked), or None to go on. One small all-reduce per step."""
        reason = self._local()
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return reason
        flag = torch.tensor([1.0 if reason is not None else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() == 0:
            return None
        return reason or "another trainer rank was asked to stop"
