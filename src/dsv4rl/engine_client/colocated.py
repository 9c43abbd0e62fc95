"""Rank 0's hold on colocated engines' memory: given back before training, taken back to roll out.

Engines and trainer share the devices, so a step goes (slime's order: `train.py` and `slime/ray/rollout.py`
of THUDM/slime, offload / onload_weights / onload_kv):

    rollout -> release(kv_cache, weights, cuda_graph) -> train -> resume(weights)
            -> push the weights (/update_weights_from_tensor) -> resume(kv_cache, cuda_graph) -> next rollout

The weights come back first so the update has memory to load into; the KV cache, usually the larger part,
only once the push is done and the trainer's temporary buffers are gone. The loop (`dsv4rl.train.loop`)
owns that order; this class makes the calls on every engine at once and remembers what it released, so
the first sync (nothing released) resumes nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from dsv4rl.config.choices import MemoryTag
from dsv4rl.engine_client.client import EngineClient, EnginePool

__all__ = ["ColocatedEngines", "KV_AND_GRAPHS"]

KV_AND_GRAPHS = (MemoryTag.kv_cache, MemoryTag.cuda_graph)


class ColocatedEngines:
    """Release and resume the memory of `clients` (SGLang's memory-saver calls), from `event_loop`."""

    def __init__(self, clients: Sequence[EngineClient], event_loop: asyncio.AbstractEventLoop) -> None:
        self.pool = EnginePool(clients)
        self.event_loop = event_loop
        self.released: list[MemoryTag] = []

    def release(self) -> None:
        """Every engine gives back all of its memory (they are idle between rollouts)."""
        self.event_loop.run_until_complete(self.pool.broadcast("release_memory_occupation", None))
        self.released = list(MemoryTag)

    def resume(self, tags: Sequence[MemoryTag]) -> None:
        """Take back `tags` where they were released (nothing to do otherwise)."""
        wanted = [tag for tag in tags if tag in self.released]
        if not wanted:
            return
        self.event_loop.run_until_complete(
            self.pool.broadcast("resume_memory_occupation", [tag.value for tag in wanted])
        )
        self.released = [tag for tag in self.released if tag not in wanted]
