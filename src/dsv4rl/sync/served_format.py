"""What each engine serves, checked against the recipe's `quant` before the first push.

An engine holds its weights in the format of the checkpoint it started from, adjusted by SGLang's
environment (`dsv4rl.quant.sglang_env`): the reference engine holds the checkpoint as stored; SGLang may
convert MXFP4 experts to FP8, and holds expert scales as its MoE runner creates them (E8M0 for MXFP4 under
aiter or flashinfer_mxfp4, float32 otherwise; the runner is `dsv4rl.quant.sglang_moe`'s row). The trainer
reads the checkpoint each engine reports in `/model_info` (or the planned `model.path` when that path
is not readable here), decides what the engine holds, and builds the wire format from it, so the wire
follows the engine rather than a guess. A recipe whose `quant` differs stops here, naming both.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dsv4rl.config.choices import ExpertScaleDtype, QuantMode, RolloutEngineKind
from dsv4rl.config.schema import QuantConfig
from dsv4rl.model.native_checkpoint import CheckpointError, CheckpointFormat, checkpoint_format
from dsv4rl.model.wire_format import WireFormat
from dsv4rl.quant import sglang_env
from dsv4rl.quant.fp8 import E4M3
from dsv4rl.quant.scales import E8M0
from dsv4rl.quant.sglang_moe import MoePath
from dsv4rl.sync.errors import WeightSyncError, engine_name
from dsv4rl.wire.engine_api import EngineAPI

__all__ = ["ServedFormat", "check_served_formats", "served_format", "wire_format_for"]


@dataclass(frozen=True)
class ServedFormat:
    """What one engine holds: the quant mode it matches and the dtype of its routed-expert scales."""

    mode: QuantMode | None
    expert_scale_dtype: torch.dtype | None
    block: tuple[int, int]
    source: str  # the checkpoint it was read from, for messages


def served_format(
    engine: RolloutEngineKind,
    checkpoint: CheckpointFormat,
    env: Mapping[str, str],
    source: str,
    moe: MoePath | None = None,
) -> ServedFormat:
    """The format an engine of kind `engine` started from `checkpoint` with `env` holds; `moe`: the SGLang
    engines' MoE path (the runner decides the dtype of MXFP4 expert scales), None when not known."""
    if engine == RolloutEngineKind.reference:
        return ServedFormat(checkpoint.mode, checkpoint.expert_scale_dtype, checkpoint.block, source)
    held = sglang_env.expert_format(env, checkpoint.experts)
    mode = checkpoint.mode
    if checkpoint.linear_dtype == E4M3:
        mode = {sglang_env.MXFP4: QuantMode.fp8_mxfp4, sglang_env.FP8: QuantMode.fp8_rollout}.get(held)
    scale = None
    if held in (sglang_env.MXFP4, sglang_env.FP8):
        runner = moe.resolves_to.value if moe is not None and moe.resolves_to is not None else None
        scale = getattr(torch, sglang_env.expert_scale_dtype(env, held, runner))
    return ServedFormat(mode, scale, checkpoint.block, source)


def wire_format_for(quant: QuantConfig, served: Sequence[tuple[str, ServedFormat]]) -> WireFormat:
    """The wire format for engines that serve `served` [(engine, format)]; WeightSyncError on a mismatch."""
    problems = []
    for engine, fmt in served:
        if fmt.mode != quant.name:
            what = fmt.mode.value if fmt.mode is not None else "a layout no quant mode produces"
            fix = f"run with quant={fmt.mode.value}, or" if fmt.mode is not None else "convert it, or"
            problems.append(
                f"engine {engine} serves {what} (from {fmt.source}), but the recipe sends "
                f"quant={quant.name.value}: {fix} start the engines from a {quant.name.value} checkpoint"
            )
        elif QuantMode(fmt.mode).quantized and tuple(quant.block_size) != fmt.block:
            problems.append(
                f"engine {engine} holds FP8 blocks of {list(fmt.block)} (from {fmt.source}), but "
                f"quant.block_size={list(quant.block_size)}: set quant.block_size={list(fmt.block)}"
            )
    scales = {fmt.expert_scale_dtype for _, fmt in served if fmt.expert_scale_dtype is not None}
    if quant.expert_scale_dtype != ExpertScaleDtype.auto:
        wanted = getattr(torch, quant.expert_scale_dtype.value)
        for engine, fmt in served:
            if fmt.expert_scale_dtype is not None and fmt.expert_scale_dtype != wanted:
                held = str(fmt.expert_scale_dtype).removeprefix("torch.")
                problems.append(
                    f"engine {engine} holds routed-expert scales as {held}, but quant.expert_scale_dtype="
                    f"{quant.expert_scale_dtype.value}: use quant.expert_scale_dtype=auto (the wire follows "
                    "what the engine holds)"
                )
        scale = wanted
    elif len(scales) > 1:
        problems.append(
            "the engines hold routed-expert scales in different dtypes "
            f"({sorted(str(s).removeprefix('torch.') for s in scales)}): one broadcast cannot serve both; "
            "run engines of one platform"
        )
        scale = E8M0
    else:
        scale = scales.pop() if scales else E8M0
    if problems:
        raise WeightSyncError(
            "the engines do not serve what the recipe sends:\n  - " + "\n  - ".join(problems)
        )
    return WireFormat(quant.name, tuple(quant.block_size), scale)


def _engine_checkpoint(info: Any, fallback: str) -> tuple[str, CheckpointFormat]:
    """(path, format) of an engine's checkpoint: its /model_info path when readable, else `fallback`."""
    reported = info.get("model_path") if isinstance(info, dict) else None
    for path in (reported, fallback):
        if path and Path(path).is_dir():
            try:
                return path, checkpoint_format(path)
            except CheckpointError as error:
                raise WeightSyncError(f"cannot tell what {path} holds: {error}") from None
    raise WeightSyncError(
        f"neither the engine's checkpoint ({reported}) nor model.path ({fallback}) is readable on this "
        "node: the trainer reads it to send what the engines hold; mount it on the trainer node"
    )


def check_served_formats(
    clients: Sequence[EngineAPI],
    quant: QuantConfig,
    engine: RolloutEngineKind,
    env: Mapping[str, str],
    model_path: str,
    event_loop: asyncio.AbstractEventLoop,
    moe: MoePath | None = None,
) -> WireFormat:
    """Ask every engine what it serves (`/model_info` -> its checkpoint) and return the wire format to send.
    `moe`: the SGLang engines' MoE path (`sglang_moe.recipe_moe_path`).

    Raises WeightSyncError naming each engine whose format differs from `quant` (before any push).
    """

    async def infos() -> list[Any]:
        return await asyncio.gather(*(client.model_info() for client in clients))

    served = []
    for client, info in zip(clients, event_loop.run_until_complete(infos()), strict=True):
        path, checkpoint = _engine_checkpoint(info, model_path)
        fmt = served_format(engine, checkpoint, env, f"checkpoint {path}", moe)
        served.append((engine_name(client), fmt))
    return wire_format_for(quant, served)
