"""What answers an assistant turn: an environment. Tools are the special case `ToolEnv` implements.

An environment (`rollout.env: pkg.module:Class`, built with `rollout.env_kwargs`) has
`async reset(problem) -> messages` (the conversation a trajectory starts from; or `EnvReset(messages,
state)` to keep a state of its own) and `async step(state, assistant_message) -> EnvStep` (the messages
that answer the turn, a reward for it, whether the trajectory is done). `problem` is the data row
(`dsv4rl.data.Problem`); `state` is what reset kept, else the problem. An optional `async close(state)` runs
on every path out. The rollout drives a user's environment through `UserEnv` (its failures counted) and
the recipe's tools through `ToolEnv`: both through the same `reset` / `step` / `close`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from dsv4rl.config.choices import MalformedCall, TruncateSide
from dsv4rl.config.schema import RolloutConfig
from dsv4rl.data.problems import Problem
from dsv4rl.rollout.tool_failures import ENV_NAME, ToolFailure
from dsv4rl.rollout.turn_format import AssistantTurn, ParsedCall, TurnFormat
from dsv4rl.tools.base import Tool, ToolResult, as_tool_result, schema_problems, warn_old_row_name


@dataclass
class EnvStep:
    """An environment's answer to one assistant turn. `finish` names why a done trajectory ended
    (`stop`, `tool_budget`, `abort`); `calls` are the tool calls' records (ToolEnv); `runs` the calls that
    ran, each its tool's name and its failure (None: the tool answered; `dsv4rl.rollout.tool_failures`)."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    reward: float | None = None
    done: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    finish: str = "stop"
    calls: list[dict[str, Any]] = field(default_factory=list)
    runs: list[tuple[str, ToolFailure | None]] = field(default_factory=list)


@dataclass
class EnvReset:
    messages: list[dict[str, Any]]
    state: Any = None


class Env(Protocol):
    async def reset(self, problem: Problem) -> list[dict[str, Any]] | EnvReset: ...

    async def step(self, state: Any, assistant_message: dict[str, Any]) -> EnvStep: ...


class UserEnv:
    """`rollout.mode=env`: the user's environment as the rollout drives it. Each step counts as one call
    of the environment (`env`, against `max_turns`); a step that raised is the environment's failure: the
    trajectory ends (abort) and the failure is counted, logged and bounded (`rollout.tool_failures`)."""

    def __init__(self, env: Any, spec: str):
        self.env = env
        self.what = f"environment {spec!r}"
        warn_old_row_name(env.reset, f"rollout.env={spec!r}: reset")

    def call_budget(self, rollout: RolloutConfig) -> int:
        return rollout.max_turns

    async def reset(self, problem: Problem) -> list[dict[str, Any]] | EnvReset:
        return await self.env.reset(problem)

    async def step(self, state: Any, assistant_message: dict[str, Any]) -> EnvStep:
        try:
            step = await self.env.step(state, dict(assistant_message))
            step = step if isinstance(step, EnvStep) else EnvStep(**step)
        except Exception as error:  # noqa: BLE001  (the environment's failure: counted, bounded, recorded)
            failure = ToolFailure.raised(ENV_NAME, self.what, error)
            return EnvStep(done=True, finish="abort", runs=[(ENV_NAME, failure)])
        return dataclasses.replace(step, runs=[(ENV_NAME, None), *step.runs])

    async def close(self, state: Any) -> None:
        close = getattr(self.env, "close", None)
        if close is not None:
            await close(state)


def truncate_ids(ids: list[int], limit: int, side: TruncateSide) -> list[int]:
    """At most `limit` ids: the beginning (`left`), the end (`right`), or both ends (`middle`)."""
    if len(ids) <= limit:
        return ids
    if side == TruncateSide.left:
        return ids[:limit]
    if side == TruncateSide.right:
        return ids[len(ids) - limit :]
    head = (limit + 1) // 2
    return ids[:head] + ids[len(ids) - (limit - head) :]


@dataclass
class ToolCounts:
    """One trajectory's tool calls so far (`max_tool_calls`) and what they cost."""

    calls: int = 0
    parse_errors: int = 0
    errors: int = 0
    timeouts: int = 0
    time_s: float = 0.0


@dataclass
class ToolState:
    states: dict[str, Any]  # each tool's state for this trajectory
    counts: ToolCounts = field(default_factory=ToolCounts)
    turns: int = 0  # the assistant turns stepped so far


class ToolEnv:
    """`rollout.mode=tools`: the calls of a turn are run (at most `max_parallel_calls` at once, and at
    most `max_concurrent_tools` over all trajectories through `pool`), their results go back as tool
    messages; a turn without calls is the final answer. Malformed calls never raise: their error is the
    call's result (`on_malformed_call=feedback`) or ends the trajectory (`terminate`)."""

    def __init__(
        self,
        tools: Sequence[Tool],
        timeouts: dict[str, float],
        rollout: RolloutConfig,
        fmt: TurnFormat,
        pool: asyncio.Semaphore,
    ):
        self.tools = {tool.name: tool for tool in tools}
        for name, tool in self.tools.items():
            warn_old_row_name(tool.open, f"tool {name!r}: open")
        self.timeouts = timeouts
        self.cfg = rollout
        self.format = fmt
        self.pool = pool

    def call_budget(self, rollout: RolloutConfig) -> int:
        return rollout.max_tool_calls

    async def reset(self, problem: Problem) -> EnvReset:
        states: dict[str, Any] = {}
        try:
            for name, tool in self.tools.items():
                states[name] = await tool.open(problem)
        except BaseException:
            await self._close(states)
            raise
        return EnvReset(self.format.initial_messages(problem), ToolState(states))

    async def close(self, state: ToolState) -> None:
        await self._close(state.states)

    async def _close(self, states: dict[str, Any]) -> None:
        for name, value in states.items():
            with contextlib.suppress(Exception):  # a failing close must not hide the trajectory
                await self.tools[name].close(value)

    async def step(self, state: ToolState, assistant_message: dict[str, Any]) -> EnvStep:
        """Runs the turn's calls; a turn without calls is the final answer. The rollout's message carries
        the turn as it was parsed (`AssistantMessage`); a plain message's calls are read from `tool_calls`.
        A turn with calls on the last of `max_turns` ends the trajectory with them unrun (no turn is left
        to read their results)."""
        turn = getattr(assistant_message, "turn", None) or AssistantTurn.from_message(
            assistant_message, list(self.tools)
        )
        state.turns += 1
        if turn.calls and state.turns >= self.cfg.max_turns:
            return EnvStep(done=True, finish="max_turns")
        if turn.parse_error is not None and not turn.calls:
            state.counts.parse_errors += 1
            if self.cfg.on_malformed_call == MalformedCall.terminate:
                return EnvStep(done=True, finish="abort", metrics={"parse_error": 1.0})
            return EnvStep(done=True)  # unreadable and nothing to answer: the turn is the final one
        if not turn.calls:
            return EnvStep(done=True)
        counts = state.counts
        if counts.calls + len(turn.calls) > self.cfg.max_tool_calls:
            return EnvStep(done=True, finish="tool_budget")
        for call in turn.calls:
            if call.error is None:
                problems = schema_problems(self.tools[call.name].schema, call.args)
                if problems:
                    call.error = "; ".join(problems)
        bad = [c for c in turn.calls if c.error is not None]
        counts.parse_errors += len(bad)
        if bad and self.cfg.on_malformed_call == MalformedCall.terminate:
            return EnvStep(done=True, finish="abort")
        limit = asyncio.Semaphore(max(1, self.cfg.max_parallel_calls))
        results = await asyncio.gather(*(self._run(state, call, limit) for call in turn.calls))
        counts.calls += len(turn.calls)
        messages, rewards, records, runs, done = [], [], [], [], False
        for call, (result, seconds, failure) in zip(turn.calls, results, strict=True):
            text = self._truncate(result.text)
            messages.append(self.format.tool_message(call.id, text))
            if result.reward is not None:
                rewards.append(float(result.reward))
            done = done or result.done
            counts.errors += int(result.error and call.error is None)
            counts.timeouts += int(result.timed_out)
            counts.time_s += seconds
            if call.error is None:
                runs.append((call.name, failure))
            records.append(
                {
                    "id": call.id,
                    "name": call.name,
                    "arguments": call.arguments,
                    "malformed": call.error is not None,
                    "error": result.error,
                    "timed_out": result.timed_out,
                    "time_s": seconds,
                    "result": text,
                    **({"reward": result.reward} if result.reward is not None else {}),
                    **({"exception": failure.record()} if failure is not None else {}),
                }
            )
        metrics: dict[str, float] = {}
        for result, _, _ in results:
            for key, value in result.metrics.items():
                metrics[key] = metrics.get(key, 0.0) + float(value)
        rewarded = sum(rewards) if rewards else None
        return EnvStep(messages, rewarded, done, metrics, "stop", records, runs)

    async def _run(
        self, state: ToolState, call: ParsedCall, limit: asyncio.Semaphore
    ) -> tuple[ToolResult, float, ToolFailure | None]:
        """One call: its result, its seconds, and its failure when the tool raised or ran past its
        timeout_s (the model reads a short error result; the rollout counts, logs and records it)."""
        if call.error is not None:
            return ToolResult(text=f"error: {call.error}", error=True), 0.0, None
        async with limit, self.pool:
            began = time.monotonic()
            timeout = self.timeouts.get(call.name, 30.0)
            deadline = asyncio.timeout(timeout)
            failure = None
            try:
                async with deadline:
                    value = await self.tools[call.name].call(state.states[call.name], dict(call.args))
                result = as_tool_result(value)
            except Exception as error:  # noqa: BLE001  (the tool's failure: an error result, counted)
                what = f"tool {call.name!r}"
                if isinstance(error, TimeoutError) and deadline.expired():
                    failure = ToolFailure.timeout(call.name, what, timeout)
                    text = f"error: the call timed out after {timeout:g} s"
                else:
                    failure = ToolFailure.raised(call.name, what, error)
                    text = failure.model_text()
                result = ToolResult(text=text, error=True, timed_out=failure.timed_out)
            return result, time.monotonic() - began, failure

    def _truncate(self, text: str) -> str:
        ids = self.format.count_tokens(text)
        limit = self.cfg.max_tool_output_tokens
        if len(ids) <= limit:
            return text
        return self.format.decode(truncate_ids(ids, limit, self.cfg.truncate_side))
