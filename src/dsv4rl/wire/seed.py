"""Seed mixing shared by the engine (each sequence's generator) and the rollout (each sample's seed)."""

from __future__ import annotations

__all__ = ["mix_seed"]

_MASK64 = (1 << 64) - 1


def mix_seed(*values: int) -> int:
    """A deterministic 63-bit seed from integers (splitmix64), so nearby seeds give unrelated streams."""
    state = 0x9E3779B97F4A7C15
    for value in values:
        state = (state ^ (value & _MASK64)) & _MASK64
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        state = z ^ (z >> 31)
    return state & ((1 << 63) - 1)
