"""What each engine serves, checked against the recipe's model before the first rollout.

SGLang 0.5.23 reports little of the model it built: `/model_info` gives `model_path`, `model_type` and
`architectures` (its `hf_config` line is commented out: `sglang/srt/entrypoints/http_server.py:812-843`),
and `/server_info` its resolved launch arguments, `dtype` and `json_model_override_args` among them
(`http_server.py:863`, `sglang/srt/utils/common.py:3584` `build_server_info`); the `dtype` it resolves
`auto` to, the compress ratios and the hash-routed layers it built appear only in its start-up log. So the
trainer reads the config.json at the path the engine reports, applies the overrides as SGLang does, and
decides what the engine built the way that engine reads it (SGLang: the release's keys only, see
`dsv4rl.model.release_config`; the reference engine: transformers' keys). It stops, naming each engine and
difference, when that is not the model the trainer loaded from `model_path` (its layers, hash-routed
layers, sliding window and shapes), when the config's two key sets disagree, or when the engine computes
in float16 (SGLang's `--dtype auto` on a float32 checkpoint).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dsv4rl.config.choices import Dtype, RolloutEngineKind
from dsv4rl.model.native_checkpoint import CheckpointError, read_config
from dsv4rl.model.release_config import release_key_problems, sglang_problems, transformers_schedule
from dsv4rl.sync.errors import WeightSyncError, engine_name
from dsv4rl.wire.engine_api import EngineAPI

__all__ = [
    "SGLANG_MODEL_INFO_KEYS",
    "check_served_models",
    "served_config",
    "served_dtype",
    "served_model_problems",
]

# The keys of SGLang 0.5.23's /model_info for a generation model (`http_server.py:815-841`); the reference
# engine answers the same.
SGLANG_MODEL_INFO_KEYS = frozenset({
    "model_path", "served_model_name", "tokenizer_path", "is_generation", "preferred_sampling_params",
    "weight_version", "load_format", "reasoning_parser", "tool_call_parser", "disaggregation_mode",
    "has_image_understanding", "has_audio_understanding", "model_type", "architectures",
})  # fmt: skip
MODEL_TYPE, ARCHITECTURE = "deepseek_v4", "DeepseekV4ForCausalLM"
# Shapes a model of the same layers could still differ in (config.json names).
SHAPE_KEYS = (
    "vocab_size", "hidden_size", "num_attention_heads", "head_dim", "qk_rope_head_dim", "q_lora_rank",
    "o_groups", "o_lora_rank", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
    "moe_intermediate_size", "index_n_heads", "index_head_dim", "index_topk", "hc_mult",
)  # fmt: skip
SERVABLE_DTYPES = tuple(dtype.value for dtype in Dtype)  # what DeepSeek-V4 checkpoints and the trainer use
_DTYPE_NAMES = {"float": "float32", "half": "float16"}  # SGLang's --dtype aliases


def served_dtype(engine: RolloutEngineKind, launch_dtype: str | None, config: Mapping[str, Any]) -> str:
    """The dtype an engine launched with `--dtype launch_dtype` computes in on a checkpoint of `config`.

    SGLang resolves `auto` from config.json: `dtype`, else `torch_dtype`, float32 when neither, and serves a
    float32 checkpoint as float16 (`sglang/srt/configs/model_config.py:2284-2327`). The reference engine
    computes in float32 for `auto` (`dsv4rl.engine.state`).
    """
    launch = str(launch_dtype or "auto").lower()
    if launch != "auto":
        return _DTYPE_NAMES.get(launch, launch)
    if engine == RolloutEngineKind.reference:
        return "float32"
    stated = config.get("dtype") or config.get("torch_dtype")
    stated = _DTYPE_NAMES.get(str(stated), str(stated)).removeprefix("torch.") if stated else "float32"
    return "float16" if stated == "float32" else stated


def served_config(config: Mapping[str, Any], server_info: Mapping[str, Any]) -> dict[str, Any]:
    """`config` with the engine's `json_model_override_args` applied as SGLang applies them (a dict-valued
    `rope_scaling` merged into the config's, every other key replaced: `sglang/srt/utils/hf_transformers/
    config.py:405-424`)."""
    overrides = server_info.get("json_model_override_args") or {}
    if isinstance(overrides, str):
        overrides = json.loads(overrides or "{}")
    out = dict(config)
    for key, value in overrides.items():
        current = out.get(key)
        if (
            key in ("rope_scaling", "rope_parameters")
            and isinstance(value, dict)
            and isinstance(current, dict)
        ):
            out[key] = {**current, **value}
        else:
            out[key] = value
    return out


def served_model_problems(
    engine: RolloutEngineKind,
    model_info: Mapping[str, Any],
    server_info: Mapping[str, Any],
    config: Mapping[str, Any],
    recipe_config: Mapping[str, Any] | None,
) -> list[str]:
    """How what one engine serves (`model_info`, `server_info`, the `config` at its model path) differs
    from the recipe's model (`recipe_config`, the trainer's config.json; None: not readable here)."""
    problems = []
    architectures = model_info.get("architectures") or []
    if model_info.get("model_type") != MODEL_TYPE or ARCHITECTURE not in architectures:
        problems.append(
            f"it serves model_type {model_info.get('model_type')!r} ({architectures}), not {MODEL_TYPE} "
            f"({ARCHITECTURE}): start it from the recipe's model"
        )
    problems += [f"its config.json: {p}" for p in release_key_problems(config)]
    served = served_config(config, server_info)
    if engine == RolloutEngineKind.sglang:
        problems += [f"SGLang builds another model than transformers: {p}" for p in sglang_problems(served)]
    if recipe_config is not None:
        problems += _model_differences(served, recipe_config)
    dtype = served_dtype(engine, server_info.get("dtype"), served)
    if dtype not in SERVABLE_DTYPES:
        stated = served.get("dtype") or served.get("torch_dtype")
        problems.append(
            f"it computes in {dtype} (launched with --dtype {server_info.get('dtype') or 'auto'}, checkpoint "
            f"dtype {stated}): SGLang serves a float32 checkpoint as float16 under --dtype auto "
            "(sglang/srt/configs/model_config.py:2303-2319), a range DeepSeek-V4's activations overflow; "
            f"launch it with --dtype {' or '.join(SERVABLE_DTYPES)}"
        )
    return problems


def _model_differences(served: Mapping[str, Any], recipe_config: Mapping[str, Any]) -> list[str]:
    """The engine's config against the trainer's model: layers as transformers reads both (what SGLang
    reads differently is `sglang_problems`'), and shapes."""
    try:
        ours, theirs = transformers_schedule(recipe_config), transformers_schedule(served)
    except (KeyError, TypeError, ValueError) as error:
        return [f"its layers cannot be read: {error}"]
    problems = [f"{d} (the recipe's model vs its config.json)" for d in ours.differences(theirs)]
    for key in SHAPE_KEYS:
        if key in served and key in recipe_config and served[key] != recipe_config[key]:
            problems.append(f"{key}={served[key]} but the recipe's model has {key}={recipe_config[key]}")
    return problems


def _config(path: str | None) -> dict[str, Any] | None:
    if not path or not Path(path).is_dir():
        return None
    try:
        return read_config(path)
    except (CheckpointError, OSError, ValueError):
        return None


def check_served_models(
    clients: Sequence[EngineAPI],
    engine: RolloutEngineKind,
    model_path: str,
    event_loop: asyncio.AbstractEventLoop,
) -> None:
    """Ask every engine what it serves (`/model_info`, `/server_info`) and raise WeightSyncError naming each
    engine and difference from the recipe's model at `model_path`. An engine whose config.json is not
    readable on this node is left to `dsv4rl.sync.served_format`, which names it."""

    async def answers() -> list[tuple[Any, Any]]:
        infos = await asyncio.gather(*(client.model_info() for client in clients))
        servers = await asyncio.gather(*(client.server_info() for client in clients))
        return list(zip(infos, servers, strict=True))

    recipe_config = _config(model_path)
    problems = []
    for client, (info, server) in zip(clients, event_loop.run_until_complete(answers()), strict=True):
        info, server = info if isinstance(info, dict) else {}, server if isinstance(server, dict) else {}
        reported = info.get("model_path")
        config = _config(reported) or _config(model_path)
        if config is None:
            continue
        name = engine_name(client)
        found = served_model_problems(engine, info, server, config, recipe_config)
        problems += [f"engine {name}: {p}" for p in found]
    if problems:
        raise WeightSyncError(
            f"the engines do not serve the recipe's model ({model_path}):\n  - " + "\n  - ".join(problems)
        )
