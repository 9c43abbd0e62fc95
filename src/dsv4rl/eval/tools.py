"""Evaluation with the recipe's tools: when `rollout.mode` is tools (or env), the eval samples trajectories
the way training does, so a tool-integrated model is scored as it is trained (answering without its tool
would measure another policy).

The runner is `build_multi_turn`'s with the eval's sampling and chat settings; it asks the engines for no
routing choices (the eval replays nothing). The graded text is the last assistant turn's (its answer part
with a chat format), as in training's reward (`rollout.trajectory.final_turn_text`). The report gains
`calls_per_problem` (mean tool calls per sample), `turns_mean`, the tool errors and the finish-reason
fractions (`finish/<reason>`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from dsv4rl.aio import run_on
from dsv4rl.config.compose import reward_base_dirs
from dsv4rl.config.schema import Config
from dsv4rl.data.chat_format import PromptRenderer, eval_chat_settings
from dsv4rl.data.problems import Problem
from dsv4rl.rollout.choices import ChoiceRequest
from dsv4rl.rollout.multi_turn import MultiTurn, build_multi_turn
from dsv4rl.rollout.trajectory import (
    FINISH_REASONS,
    final_turn_text,
    generate_trajectories,
    trajectory_metrics,
)
from dsv4rl.samples import Sample
from dsv4rl.wire.engine_api import EngineAPI

__all__ = ["TOOL_METRIC_KEYS", "eval_multi_turn", "final_texts", "generate_with_tools", "tool_report"]

# The report's multi-turn numbers that training's periodic eval also writes to metrics.jsonl (under eval/)
TOOL_METRIC_KEYS = (
    "calls_per_problem",
    "turns_mean",
    "tool_errors_mean",
    "tool_timeouts_mean",
    "parse_errors_mean",
    *(f"finish/{reason}" for reason in FINISH_REASONS),
)


def eval_multi_turn(cfg: Config, tokenizer: Any) -> MultiTurn | None:
    """The recipe's multi-turn rollout with the eval's sampling and chat settings; None in single_turn."""
    if cfg.eval is None:
        return None
    multi = build_multi_turn(
        cfg, tokenizer, eval_chat_settings(cfg), reward_base_dirs(cfg), sampling=cfg.eval.sampling
    )
    if multi is not None:
        multi.runner.choices = ChoiceRequest()  # no routed experts / indexer top-k: nothing is trained
    return multi


def generate_with_tools(
    multi: MultiTurn,
    clients: Sequence[EngineAPI],
    problems: Sequence[Problem],
    samples_per_problem: int,
    event_loop: asyncio.AbstractEventLoop,
    seed: int | None,
) -> list[Sample]:
    """`samples_per_problem` trajectories of every problem, prompt-major (as `generate_samples`)."""
    return run_on(
        event_loop, generate_trajectories(clients, problems, multi.runner, samples_per_problem, seed)
    )


def final_texts(renderer: PromptRenderer, samples: Sequence[Sample]) -> list[str]:
    """Each sample's last assistant turn as text: what carries its answer."""
    return [final_turn_text(renderer.tokenizer, sample) for sample in samples]


def tool_report(samples: Sequence[Sample]) -> dict[str, float]:
    """The report's multi-turn numbers: per sample means and the finish-reason fractions."""
    metrics = trajectory_metrics(samples)
    if not metrics:
        return {}
    n = max(1, sum(s.trajectory is not None for s in samples))
    return {
        "calls_per_problem": metrics["tool/calls_mean"],
        "turns_mean": metrics["turns_mean"],
        "tool_errors_mean": metrics["tool/errors"] / n,
        "tool_timeouts_mean": metrics["tool/timeouts"] / n,
        "parse_errors_mean": metrics["tool/parse_errors"] / n,
        "masked_token_fraction": metrics["masked_token_fraction"],
        "generated_len_mean": metrics["generated_len_mean"],
        **{f"finish/{reason}": metrics[f"finish/{reason}"] for reason in FINISH_REASONS},
    }
