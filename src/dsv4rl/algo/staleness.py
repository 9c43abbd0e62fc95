"""How far behind the trained policy a batch was sampled: the bound a recipe allows (`algo.max_staleness`)
and what each step measured.

A sample's staleness is counted from the version that sampled its first token (its head version): the
oldest policy any of its tokens came from, which is what a bound must limit (Miles and AReaL count the
same way). The weights a step trains are version `step - 1`, so a synchronous step's samples are 0
versions behind and a one-step-off-policy step's 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from dsv4rl.config.schema import AlgoConfig


def staleness_bound(algo: AlgoConfig) -> int:
    """`algo.max_staleness`, or what `algo.async_rollout` implies where it is not set (1 when on, else 0)."""
    if algo.max_staleness is None:
        return 1 if algo.async_rollout else 0
    return algo.max_staleness


def tis_on(algo: AlgoConfig) -> bool:
    """Whether the loss weights tokens by truncated importance sampling: as `algo.tis.enabled` says, or,
    where it is unset, whenever the run trains off-policy and MIS does not already correct it."""
    if algo.tis.enabled is not None:
        return algo.tis.enabled
    return staleness_bound(algo) >= 1 and not algo.mis.enabled


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


def partial_fraction(versions: Sequence[Sequence[str]]) -> float:
    """The share of samples whose tokens came from more than one weight version: responses a weight update
    reached mid-way and that went on under the new weights (a partial rollout). Inserted tokens ("") are
    not sampled and do not count."""
    if not versions:
        return 0.0
    return sum(len({v for v in per_token if v}) > 1 for per_token in versions) / len(versions)


def admission_capacity(
    bound: int, version: int, per_step: int, accepted: int, running: int, oversample: float = 1.0
) -> int:
    """How many more groups may start now (AReaL's staleness manager): the groups accepted so far (trained
    or waiting, filtered-out ones not counted) and those running may not exceed what the steps up to
    `version + bound + 1` train, so a group started on weights `version` is trained at most `bound`
    versions later when groups finish in order. Out of order, `too_stale` catches the rest.
    `oversample` (>= 1) counts a running group as 1 / oversample of one: that many more run, for a filter
    that keeps about that share."""
    room = (bound + version + 1) * per_step - accepted
    return max(0, math.floor(oversample * room + 1e-9) - running)


def too_stale(head_version: str, trained_version: int, bound: int) -> bool:
    """Whether a sample whose first token came from `head_version` is more than `bound` versions behind
    the weights it would train (`trained_version`). A version that is not a step number (an engine's
    initial "default") is taken as fresh."""
    try:
        return trained_version - int(head_version) > bound
    except ValueError:
        return False
