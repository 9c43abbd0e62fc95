"""How far behind the trained policy a batch was sampled: the bound a recipe allows (`algo.max_staleness`)
and what each step measured.

A sample's staleness is counted from the version that sampled its first token (its head version): the
oldest policy any of its tokens came from, which is what a bound must limit (Miles and AReaL count the
same way). The weights a step trains are version `step - 1`, so a synchronous step's samples are 0
versions behind and a one-step-off-policy step's 1.
"""

from __future__ import annotations

from collections.abc import Sequence

from dsv4rl.config.schema import AlgoConfig


def staleness_bound(algo: AlgoConfig) -> int:
    """`algo.max_staleness`, or what `algo.async_rollout` implies where it is not set (1 when on, else 0)."""
    if algo.max_staleness is None:
        return 1 if algo.async_rollout else 0
    return algo.max_staleness


def staleness_metrics(head_versions: Sequence[str], trained_version: int) -> dict[str, float]:
    """`staleness/mean` and `staleness/max` over the trained samples: how many versions behind
    `trained_version` each one's first token was sampled. Versions that are not step numbers (an engine's
    initial "default") are skipped; none left gives no keys."""
    lags = []
    for version in head_versions:
        try:
            lags.append(trained_version - int(version))
        except ValueError:
            continue
    if not lags:
        return {}
    return {"staleness/mean": sum(lags) / len(lags), "staleness/max": float(max(lags))}
