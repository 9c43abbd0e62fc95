"""The recipe's multi-turn rollout built once: tools (or the environment), the turn format, the runner.

`rollout.mode=tools` wraps `rollout.tools` in the built-in `ToolEnv`; `env` loads `rollout.env` and builds
it with `rollout.env_kwargs`. The prompt renderer carries the tools' schemas, so every prompt (and `dsv4rl
prompts`) shows the tool block the model is trained with.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsv4rl.config.choices import RolloutMode
from dsv4rl.config.schema import Config
from dsv4rl.data.chat_format import ChatSettings, PromptRenderer
from dsv4rl.rollout.choices import ChoiceRequest
from dsv4rl.rollout.env import ToolEnv, UserEnv
from dsv4rl.rollout.trajectory import TrajectoryRunner
from dsv4rl.rollout.turn_format import turn_format
from dsv4rl.targets import TargetError, load
from dsv4rl.tools.base import Tool
from dsv4rl.tools.loading import build_tools


@dataclass
class MultiTurn:
    renderer: PromptRenderer  # with the tools' schemas
    runner: TrajectoryRunner
    tools: list[Tool]


def load_env(spec: str, kwargs: dict[str, Any], base_dirs: Sequence[Path]) -> Any:
    """`rollout.env`'s class built with `rollout.env_kwargs`; TargetError naming the fix."""
    found = load(spec, base_dirs, None, role="rollout.env", what="class", builtin_noun="environment")
    env = found(**kwargs) if inspect.isclass(found) else found
    missing = [m for m in ("reset", "step") if not inspect.iscoroutinefunction(getattr(env, m, None))]
    if missing:
        raise TargetError(
            f"rollout.env={spec!r}: needs async reset(problem) and async step(state, assistant_message) "
            f"(missing or not async: {missing}); see dsv4rl.rollout.env.Env"
        )
    return env


def build_multi_turn(
    cfg: Config, tokenizer: Any, settings: ChatSettings, base_dirs: Sequence[Path], sampling=None
) -> MultiTurn | None:
    """The recipe's multi-turn rollout, or None in `single_turn` mode. `sampling`: the sampling settings
    (default `algo.sampling`; eval passes its own)."""
    rollout = cfg.rollout
    if rollout.mode == RolloutMode.single_turn:
        return None
    tools = build_tools(rollout.tools, base_dirs) if rollout.mode == RolloutMode.tools else []
    renderer = PromptRenderer(tokenizer, settings, tools=[tool.schema for tool in tools])
    fmt = turn_format(renderer)
    if rollout.mode == RolloutMode.tools:
        timeouts = {tool.name: entry.timeout_s for tool, entry in zip(tools, rollout.tools, strict=True)}
        env = ToolEnv(tools, timeouts, rollout, fmt, asyncio.Semaphore(max(1, rollout.max_concurrent_tools)))
    else:
        env = UserEnv(load_env(rollout.env or "", dict(rollout.env_kwargs), base_dirs), rollout.env or "")
    runner = TrajectoryRunner(
        rollout,
        sampling if sampling is not None else cfg.algo.sampling,
        fmt,
        env,
        tokenizer.eos_token_id,
        ChoiceRequest(cfg.algo.routing_replay, cfg.algo.indexer_replay),
    )
    return MultiTurn(renderer, runner, tools)
