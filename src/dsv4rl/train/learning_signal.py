"""Whether the run can learn: a notice on the console when every group has been flat for several steps.

A group whose rewards are all equal has zero advantage everywhere and gives no gradient; when every group
is flat the loss is zero and the weights stop moving while the progress line still ticks (`reward 0 |
reward std 0`). The watch reads each step's `reward/zero_std_fraction` and says once per flat stretch
what the numbers point at, so a user finds the cause in minutes rather than after an hour of steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dsv4rl.config.schema import Config

FLAT_STEPS = 5  # consecutive steps with every group flat before the notice (a constant reward: by step 5)
CAPPED = 0.5  # a truncated_fraction from which the response cap is named as a likely cause


def flat_causes(metrics: Mapping[str, Any], cfg: Config) -> list[str]:
    """The likely causes the step's metrics point at, most telling first."""
    causes = []
    reward = metrics.get("reward_mean")
    capped = metrics.get("truncated_fraction")
    if isinstance(capped, int | float) and capped >= CAPPED:
        causes.append(
            f"{100 * capped:.0f}% of responses hit the response cap (algo.sampling.max_new_tokens="
            f"{cfg.algo.sampling.max_new_tokens}): answers are cut before they can score; raise the cap"
        )
    if reward == 0:
        causes.append(
            "every response scores 0: check the reward functions and the answer format on saved rollouts "
            "(run.save_rollouts=N, then `dsv4rl rollouts RUN_DIR`)"
        )
    elif isinstance(reward, int | float):
        causes.append(
            f"every response in a group scores the same (reward_mean {reward:.3g}): the reward cannot tell "
            "responses apart, or the task is already solved at this difficulty"
        )
    if cfg.algo.group_size < 4:
        causes.append(f"algo.group_size={cfg.algo.group_size} makes equal rewards within a group likely")
    if cfg.algo.dynamic_sampling.enabled:
        causes.append(
            "algo.dynamic_sampling found no informative group within "
            f"max_oversample_factor={cfg.algo.dynamic_sampling.max_oversample_factor}"
        )
    return causes


class FlatRewardWatch:
    """Counts consecutive steps with every group flat; `observe` returns the notice once per stretch."""

    def __init__(self, cfg: Config, steps: int = FLAT_STEPS) -> None:
        self.cfg = cfg
        self.steps = steps
        self.flat_run = 0

    def observe(self, metrics: Mapping[str, Any]) -> str | None:
        flat = metrics.get("reward/zero_std_fraction")
        if not isinstance(flat, int | float) or flat < 1.0:
            self.flat_run = 0
            return None
        self.flat_run += 1
        if self.flat_run != self.steps:
            return None
        causes = "; ".join(flat_causes(metrics, self.cfg))
        step = metrics.get("step", "?")
        return (
            f"not learning: every group's rewards have been equal for {self.steps} steps (to step {step}; "
            f"reward/zero_std_fraction 1.0), so the loss has no gradient. Likely: {causes}"
        )
