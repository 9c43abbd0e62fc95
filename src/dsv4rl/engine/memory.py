"""What the reference engine holds, and giving it back for a colocated trainer's turn on the device.

SGLang 0.5.23's `/release_memory_occupation` and `/resume_memory_occupation`
(`srt/managers/scheduler_components/weight_updater.py`, tags from `srt/constants.py`):
- `tags` null or empty means all of kv_cache, weights, cuda_graph;
- release asserts the scheduler is idle (no running batch; queued requests count only when not paused),
  drops the KV cache (and flushes the prefix cache), stashes the model's buffers and frees the weights;
  only `--enable-memory-saver` makes it free anything on the device;
- resume takes the memory back (weights: whatever the memory holds, unless a CPU backup was kept, so the
  next weight update must rewrite them; the buffers come back from the stash) and removes each tag from
  the released set, which fails for a tag that was not released;
- both answer JSON null. A failed assertion inside the scheduler takes the server down, and nothing stops
  /generate from running on released memory.

The reference engine is stricter. It answers HTTP 400 `{"error": {"message"}}` (the error shape of these
routes) for: release while busy, release without `--enable-memory-saver`, an unknown tag, a tag released
twice, resuming a tag not released. While anything is released, and while resumed weights have not all
been rewritten, it refuses /generate and health checks (`refusal`). Released weights really are gone
(`HeldWeights.release`), so nothing computes from them by accident.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dsv4rl.config.choices import MemoryTag

if TYPE_CHECKING:
    from dsv4rl.engine.generator import Generator
    from dsv4rl.engine.weight_store import HeldWeights

__all__ = ["EngineMemory", "MemoryRefused", "parse_tags"]

NOT_IDLE = "release_memory_occupation should be called only when server is idle."  # SGLang's assertion


class MemoryRefused(ValueError):
    """A release or resume the engine will not do; nothing was changed."""


def parse_tags(tags: Sequence[str] | None) -> list[MemoryTag]:
    """SGLang's rule: null or empty is every tag; an unknown tag is refused here (SGLang ignores it)."""
    if not tags:
        return list(MemoryTag)
    known = [t.value for t in MemoryTag]
    unknown = [t for t in tags if t not in known]
    if unknown:
        raise MemoryRefused(f"unknown memory tags {unknown}; choose from {known}")
    return list(dict.fromkeys(MemoryTag(t) for t in tags))


class EngineMemory:
    """The released tags of one engine, and the weights and generator they act on."""

    def __init__(self, weights: HeldWeights, generator: Generator, *, memory_saver: bool) -> None:
        self.weights = weights
        self.generator = generator
        self.memory_saver = memory_saver
        self.released: set[MemoryTag] = set()

    def release(self, tags: Sequence[str] | None) -> list[MemoryTag]:
        wanted = parse_tags(tags)
        if not self.memory_saver:
            raise MemoryRefused(
                "release_memory_occupation frees nothing without --enable-memory-saver (SGLang's "
                "torch_memory_saver): start the engine with it (dsv4rl plans it for parallel.colocate=true)"
            )
        twice = [t.value for t in wanted if t in self.released]
        if twice:
            raise MemoryRefused(f"memory of {twice} is already released; resume_memory_occupation first")
        with self.generator.idle_exclusive() as idle:
            if not idle:
                counts = self.generator.num_requests()
                raise MemoryRefused(
                    f"{NOT_IDLE} It has {counts['running']} running and {counts['waiting']} queued requests: "
                    "pause generation (or let them finish) first"
                )
            self.released.update(wanted)  # from here on no request starts (`refusal`)
            if MemoryTag.weights in wanted:
                self.weights.release()
        return wanted

    def resume(self, tags: Sequence[str] | None) -> list[MemoryTag]:
        wanted = parse_tags(tags)
        missing = [t.value for t in wanted if t not in self.released]
        if missing:
            raise MemoryRefused(
                f"memory of {missing} is not released (released: {sorted(t.value for t in self.released)})"
            )
        with self.generator.model_lock:
            if MemoryTag.weights in wanted:
                self.weights.restore()
            self.released.difference_update(wanted)
        self.generator.wake()
        return wanted

    def refusal(self) -> str | None:
        """Why no request may run now, or None."""
        if self.released:
            tags = ", ".join(sorted(t.value for t in self.released))
            return (
                f"the engine's memory is released ({tags}): call /resume_memory_occupation before /generate"
            )
        stale = self.weights.stale
        if stale:
            return (
                f"{len(stale)} weight tensors hold no values since /resume_memory_occupation (e.g. "
                f"{sorted(stale)[0]}): update the weights before /generate"
            )
        return None

    def occupation(self) -> dict[str, Any]:
        """What the engine holds now, for /server_info: bytes of weights (stored and the forward model's),
        the released tags, and the weight tensors not rewritten since a resume. The KV cache lives only
        inside a running batch (none between batches), so it has no standing size here."""
        return {
            "weight_bytes": self.weights.nbytes(),
            "released": sorted(t.value for t in self.released),
            "stale_weight_tensors": len(self.weights.stale),
            "memory_saver": self.memory_saver,
        }
