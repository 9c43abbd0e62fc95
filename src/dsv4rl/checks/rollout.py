"""Multi-turn rollout rules (`rollout`): the mode against its tools or environment, the budgets, the chat
format; `check_rollout_targets` also imports the tools and the environment (this machine)."""

from __future__ import annotations

import inspect

from dsv4rl.checks.problems import Add
from dsv4rl.config.choices import ChatFormat, RolloutMode
from dsv4rl.config.compose import reward_base_dirs
from dsv4rl.config.schema import Config, ToolConfig
from dsv4rl.model.tokenizer_files import ARITH_CHARS, ARITH_CHARS_V41
from dsv4rl.targets import TargetError

MODES = ", ".join(RolloutMode)


def check_rollout(cfg: Config, add: Add) -> None:
    r = cfg.rollout
    mode = r.mode
    if not 0.0 <= r.max_tool_error_fraction <= 1.0:
        add(f"rollout.max_tool_error_fraction must be in [0, 1] (got {r.max_tool_error_fraction}): the share "
            "of a step's calls of one tool that may fail (raise, or run past its timeout_s) before the run "
            "stops; 0 stops at the first failure, 1 never stops (default 0.05)")  # fmt: skip
    if mode == RolloutMode.single_turn:
        if r.tools or r.env:
            add("rollout.tools / rollout.env are set but rollout.mode=single_turn runs neither: set "
                "rollout.mode=tools (or env), or remove them")  # fmt: skip
        return
    if mode == RolloutMode.tools and not r.tools:
        add("rollout.mode=tools needs at least one tool: rollout.tools=[{target: builtin:python}]")
    if mode == RolloutMode.tools and r.env:
        add("rollout.env is read only in rollout.mode=env; tools mode uses the built-in tool environment")
    if mode == RolloutMode.env and not r.env:
        add("rollout.mode=env needs rollout.env=<pkg.module:Class or path/to/file.py:Class>")
    if mode == RolloutMode.env and r.tools:
        add("rollout.tools are run only in rollout.mode=tools (an environment runs its own tools)")
    for key in ("max_turns", "max_tool_calls", "max_parallel_calls", "max_total_tokens",
                "max_tool_output_tokens", "max_concurrent_tools"):  # fmt: skip
        if getattr(r, key) < 1:
            add(f"rollout.{key} must be >= 1 (got {getattr(r, key)})")
    per_turn = r.max_new_tokens_per_turn or cfg.algo.sampling.max_new_tokens
    if r.max_new_tokens_per_turn is not None and r.max_new_tokens_per_turn < 1:
        add(f"rollout.max_new_tokens_per_turn must be >= 1 or null (got {r.max_new_tokens_per_turn})")
    elif per_turn > r.max_total_tokens:
        add(f"a turn may generate {per_turn} tokens but the whole trajectory only "
            f"rollout.max_total_tokens={r.max_total_tokens}: raise max_total_tokens or lower "
            "rollout.max_new_tokens_per_turn")  # fmt: skip
    if mode == RolloutMode.tools:
        check_sandbox_timeouts(r.tools, add)
    chars = cfg.model.tokenizer in (ARITH_CHARS, ARITH_CHARS_V41)
    if cfg.data.chat_format != ChatFormat.none and chars and r.tools:
        add(f"rollout.mode=tools with data.chat_format={cfg.data.chat_format} writes DSML calls, which the "
            "tiny character tokenizer cannot spell: use chat_format=none (the plain `?` call syntax) or "
            "the model's own tokenizer (model.tokenizer=deepseek_v4 for DeepSeek-V4)")  # fmt: skip


def check_rollout_targets(cfg: Config, add: Add) -> None:
    """The tools and the environment load and build on this machine (user modules are imported)."""
    from dsv4rl.rollout.multi_turn import load_env
    from dsv4rl.tools.loading import tool_problems

    r = cfg.rollout
    dirs = reward_base_dirs(cfg)
    if r.mode == RolloutMode.tools:
        for problem in tool_problems(r.tools, dirs):
            add(problem)
    if r.mode == RolloutMode.env and r.env:
        try:
            load_env(r.env, dict(r.env_kwargs), dirs)
        except (TargetError, TypeError) as error:
            add(f"rollout.env: {error}")


def check_sandbox_timeouts(tools: list[ToolConfig], add: Add) -> None:
    """`builtin:python` kills the model's code at its own `kwargs.timeout_s` and answers the model (its
    error); the rollout's `timeout_s` must leave it the time to, or the model's endless loops would count as
    the tool's failures (rollout.max_tool_error_fraction)."""
    from dsv4rl.tools.python_tool import PythonTool

    default = inspect.signature(PythonTool).parameters["timeout_s"].default
    for index, entry in enumerate(tools):
        if entry.target != "builtin:python":
            continue
        sandbox = entry.kwargs.get("timeout_s", default)
        if isinstance(sandbox, int | float) and sandbox >= entry.timeout_s:
            add(f"rollout.tools[{index}]: builtin:python kills the model's code after kwargs.timeout_s="
                f"{sandbox:g} but the rollout stops the call at timeout_s={entry.timeout_s:g}: the model's "
                "slow code would count as the tool's failure (rollout.max_tool_error_fraction); set "
                "timeout_s a few seconds above kwargs.timeout_s (its start and reaping)")  # fmt: skip
