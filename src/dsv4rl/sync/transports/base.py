"""What `WeightSync` asks of a transport, whichever way the buckets travel (broadcast or tensor handles)."""

from __future__ import annotations

from typing import Protocol

from dsv4rl.wire.layout import NamedTensor

__all__ = ["Transport"]


class Transport(Protocol):
    """Moves buckets to every engine. `WeightSync` opens and closes the engines' update session around
    the sends; the transport owns only what the buckets travel over (a process group, or nothing)."""

    broken: str | None  # why the transport can no longer be used after a failed transfer, else None

    def connect(self) -> None:
        """Make the transport usable (join the engines' process group, or nothing); WeightSyncError if not."""
        ...

    def send(
        self, bucket: list[NamedTensor], weight_version: str | None, what: str, *, flush_cache: bool = False
    ) -> int:
        """Send one bucket to every engine and return its payload bytes once every engine loaded it. The
        last bucket sets `weight_version` and flushes the prefix cache (`flush_cache`) in the same request."""
        ...

    def close(self) -> None:
        """Tear down what `connect` built, on the engines and here; safe to call twice, never raises."""
        ...
