"""The learning-rate schedule of every trainer backend: a multiplier of `optim.lr` by optimizer step.

The update loop (`dsv4rl.train.update`) asks it for the step's rate and hands that rate to the backend's
optimizer, so both backends follow the one schedule the same way, and a checkpoint needs only the count
of optimizer steps taken to resume it.
"""

from __future__ import annotations

import math

from dsv4rl.config.choices import LRSchedule
from dsv4rl.config.schema import Config


class LearningRateSchedule:
    """Linear warmup over `warmup` optimizer steps (step k uses (k+1)/warmup), then constant, or a cosine
    decay to `min_ratio` at step `total` - 1."""

    def __init__(
        self,
        warmup: int,
        total: int = 0,
        kind: LRSchedule | str = LRSchedule.constant,
        min_ratio: float = 0.1,
    ) -> None:
        if kind not in list(LRSchedule):
            raise ValueError(f"optim.lr_schedule={kind!r}: choose {' or '.join(LRSchedule)}")
        self.warmup, self.total, self.kind, self.min_ratio = warmup, total, LRSchedule(kind), min_ratio

    @classmethod
    def from_config(cls, cfg: Config) -> LearningRateSchedule:
        """The recipe's schedule over the run's optimizer steps (`algo.updates_per_step` per train step)."""
        optim = cfg.optim
        return cls(
            optim.warmup_steps,
            total=cfg.train.steps * cfg.algo.updates_per_step,
            kind=optim.lr_schedule,
            min_ratio=optim.min_lr_ratio,
        )

    def __call__(self, step: int) -> float:
        if self.warmup > 0 and step < self.warmup:
            return (step + 1) / self.warmup
        if self.kind == LRSchedule.constant or self.total <= self.warmup + 1:
            return 1.0
        progress = min(1.0, (step - self.warmup) / (self.total - 1 - self.warmup))
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
