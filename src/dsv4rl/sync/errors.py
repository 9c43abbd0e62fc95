"""How a failed weight sync is reported: one error type, and messages that name each engine."""

from __future__ import annotations

import concurrent.futures as cf

from dsv4rl.faults.nonfinite import NonFiniteError
from dsv4rl.wire.engine_api import EngineAPI

__all__ = ["NonFiniteWeight", "WeightSyncError", "engine_name", "post_error", "post_states"]


class WeightSyncError(RuntimeError):
    """A weight sync step failed; the message names the engine and step and says how to recover."""


class NonFiniteWeight(WeightSyncError, NonFiniteError):
    """A tensor with a NaN or Inf was about to be sent: refused before its bucket left (a sync error, so
    that a stage's sender drains and reports it like any other, and a `NonFiniteError` naming it)."""


def engine_name(client: EngineAPI) -> str:
    """The engine's URL (`base_url`), or what the client prints as (a test's fake)."""
    return str(getattr(client, "base_url", client))


def post_error(client: EngineAPI, future: cf.Future) -> str:
    """What one engine's request came to: no answer yet, or its error naming the engine once."""
    if not future.done():
        return f"engine {engine_name(client)}: no answer"
    exc = future.exception()
    return str(exc) if engine_name(client) in str(exc) else f"engine {engine_name(client)}: {exc!r}"


def post_states(posts: list[tuple[EngineAPI, cf.Future]]) -> str:
    """Every engine's request state, for a message about a transfer that stalled or failed."""
    return "; ".join(
        post_error(c, f) if not f.done() or f.exception() else f"engine {engine_name(c)}: ok"
        for c, f in posts
    )
