"""The engine API as its callers use it: the SGLang 0.5.23 HTTP calls the weight sync, the sync checks,
colocated memory, rollouts and evals make on an engine.

`dsv4rl.engine_client.client.EngineClient` implements it over HTTP (for SGLang and the reference engine
alike); tests stand in with fakes. It lives here, below both sides, so the trainer's weight sync types its
engines without importing the engine client.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

__all__ = ["EngineAPI"]


class EngineAPI(Protocol):
    """One engine's HTTP API; every call raises (naming the engine) when the engine refuses or fails."""

    # ----------------------------------------------------------------------------------- health / info
    async def wait_healthy(self, timeout_s: float, should_abort: Callable[[], bool] | None = None) -> None:
        """Until /health_generate answers 200, within `timeout_s`."""
        ...

    async def model_info(self) -> dict:
        """GET /model_info (the checkpoint the engine serves)."""
        ...

    async def server_info(self) -> dict:
        """GET /server_info (the engine's launch arguments, `dtype` among them)."""
        ...

    # ----------------------------------------------------------------------------------- generation
    async def generate(
        self,
        input_ids: list[int] | list[list[int]],
        sampling_params: dict | list[dict],
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        rid: str | None = None,
        return_routed_experts: bool = False,
        return_indexer_topk: bool = False,
    ) -> dict | list[dict]:
        """POST /generate with token ids (one item, or a batch: then a list of answers); the `return_*`
        flags ask for meta_info's routed_experts / indexer_topk."""
        ...

    async def pause_generation(self, mode: str = "abort") -> Any: ...

    async def continue_generation(self) -> Any: ...

    async def flush_cache(self, timeout_s: float = 0.0) -> str: ...

    async def freeze_gc(self) -> str: ...

    # ----------------------------------------------------------------------------------- weights
    async def begin_weight_update(self) -> dict: ...

    async def end_weight_update(self) -> dict: ...

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> dict:
        """Answers once the engine joined the group's rendezvous (the trainer joins meanwhile)."""
        ...

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str = "weight_update_group",
        flush_cache: bool = False,
        weight_version: str | None = None,
        load_format: str | None = None,
    ) -> dict:
        """Answers once the engine received (by broadcast) and loaded every tensor of the bucket."""
        ...

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[str],
        load_format: str | None = None,
        flush_cache: bool = False,
        weight_version: str | None = None,
    ) -> dict:
        """Answers once the engine loaded the tensors behind the handles (one entry per TP rank)."""
        ...

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict: ...

    async def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> dict: ...

    async def weights_checker(
        self, action: str = "checksum", skip_tensor_list: list[str] | None = None
    ) -> dict: ...

    # ----------------------------------------------------------------------------------- memory
    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None: ...

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None: ...

    async def aclose(self) -> None:
        """Close this event loop's connections."""
        ...
