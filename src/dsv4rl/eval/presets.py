"""Eval sampling presets, named after the work that published them (`dsv4rl eval --preset NAME`).

- dapo: temperature 1.0, top-p 0.7 (DAPO, Yu et al. 2025, AIME-2024 evaluation; they also sample 32
  times with a 20480-token cap).
- deepseek_r1: temperature 0.6, top-p 0.95 (DeepSeek-R1 report, 2025; 64 samples, 32768-token cap).

A preset sets temperature and top-p only; the number of samples (`eval.samples_per_problem`) and the
response cap (`eval.sampling.max_new_tokens`) stay the recipe's, and overrides given on the command line
win over the preset.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["SamplingPreset", "preset_overrides"]


class SamplingPreset(StrEnum):
    dapo = "dapo"
    deepseek_r1 = "deepseek_r1"


PRESETS: dict[SamplingPreset, dict[str, float]] = {
    SamplingPreset.dapo: {"temperature": 1.0, "top_p": 0.7},
    SamplingPreset.deepseek_r1: {"temperature": 0.6, "top_p": 0.95},
}


def preset_overrides(preset: SamplingPreset | None) -> list[str]:
    """Hydra overrides of `eval.sampling` for `preset` (to come before the user's own)."""
    if preset is None:
        return []
    return [f"eval.sampling.{key}={value}" for key, value in PRESETS[preset].items()]
