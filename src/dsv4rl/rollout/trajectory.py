"""Multi-turn rollouts (`rollout.mode` tools / env), token in and token out.

A trajectory: render the conversation, generate a turn from the ids so far, parse it, let the
environment answer (for tools: run the calls), render the conversation again, and generate the next turn
from the ids so far plus what the template inserted. The model's sampled ids and the engine's log-probs
are appended verbatim (loss mask 1); everything else is the difference between the new render and the
end of the assistant turn in it (loss mask 0). The model's own tokens are never re-tokenized: the
earlier render must be a prefix of the later one (`rollout.tito_check`), and a turn the template would
tokenize differently is kept as sampled (counted in `tool/retokenized_turns`).

Budgets: `max_turns`, `max_tool_calls`, `max_new_tokens_per_turn` (each turn's cap, clamped to what is
left of `max_total_tokens`, which counts the whole trajectory after the prompt, inserted tokens
included). Every trajectory keeps why it ended: `stop` (a final answer, or the environment said done),
`length` (a token budget), `max_turns`, `tool_budget`, `abort` (the engine aborted, a render that is not
append-only under `tito_check=strict`, a malformed call under `on_malformed_call=terminate`, an
environment whose step raised).

A tool that raises or runs past its `timeout_s`, or an environment whose step raises, is the tool's failure,
not the model's: counted, logged with its traceback, recorded, and bounded by
`rollout.max_tool_error_fraction` (`dsv4rl.rollout.tool_failures`).

Turns of different trajectories are sent together: `TurnBatcher` gathers the requests that arrive within
a few milliseconds into one batched /generate per engine, so 512 trajectories do not make 512 calls.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dsv4rl.config.choices import TitoCheck
from dsv4rl.config.schema import RolloutConfig, SamplingConfig
from dsv4rl.data.problems import Problem
from dsv4rl.rollout.choices import ChoiceRequest
from dsv4rl.rollout.env import EnvReset, ToolEnv, UserEnv
from dsv4rl.rollout.generate import GroupHook, Reroute, sample_seed, sampling_params
from dsv4rl.rollout.tool_failures import ENV_NAME, FailureLog, StepFailures
from dsv4rl.rollout.turn_format import AssistantMessage, AssistantTurn, TurnFormat
from dsv4rl.rollout.versions import token_versions
from dsv4rl.samples import Sample, Trajectory, TurnRecord
from dsv4rl.wire.choices import decode_rows
from dsv4rl.wire.engine_api import EngineAPI
from dsv4rl.wire.seed import mix_seed

log = logging.getLogger(__name__)

BATCH_LINGER_S = 0.005  # how long the first queued turn waits for others before its batch is sent
FINISH_REASONS = ("stop", "length", "max_turns", "tool_budget", "abort")


class TurnBatcher:
    """One engine's turn requests, sent as batched /generate calls (see the module doc)."""

    def __init__(self, client: EngineAPI, asks: dict[str, bool], linger_s: float = BATCH_LINGER_S):
        self.client = client
        self.asks = asks
        self.linger_s = linger_s
        self.pending: list[tuple[list[int], dict, asyncio.Future]] = []
        self.timer: asyncio.TimerHandle | None = None
        self.sends: set[asyncio.Task] = set()

    async def generate(self, ids: list[int], params: dict) -> dict:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.pending.append((ids, params, future))
        if self.timer is None:
            self.timer = loop.call_later(self.linger_s, self._flush)
        return await future

    def _flush(self) -> None:
        self.timer = None
        batch, self.pending = self.pending, []
        if batch:
            task = asyncio.ensure_future(self._send(batch))
            self.sends.add(task)
            task.add_done_callback(self.sends.discard)

    async def _send(self, batch: list[tuple[list[int], dict, asyncio.Future]]) -> None:
        try:
            outputs = await self.client.generate(
                [ids for ids, _, _ in batch],
                [params for _, params, _ in batch],
                return_logprob=True,
                **self.asks,
            )
            outputs = outputs if isinstance(outputs, list) else [outputs]
            if len(outputs) != len(batch):
                raise ValueError(f"the engine answered {len(outputs)} outputs for {len(batch)} turns")
        except BaseException as error:
            for _, _, future in batch:
                if not future.done():
                    future.set_exception(error)
            if not isinstance(error, Exception):
                raise
            return
        for (_, _, future), output in zip(batch, outputs, strict=True):
            if not future.done():
                future.set_result(output)


@dataclass
class TurnChoices:
    """The engine's choices of a trajectory stitched over turns: each position's row comes from the first
    call that forwarded it (a turn's own tokens from its decode, inserted tokens and each turn's last
    token from the next turn's prefill)."""

    routed: list[np.ndarray]
    indexer: list[np.ndarray]
    covered: int = 0

    def add(self, meta: dict, rows: int, asked: ChoiceRequest) -> None:
        if asked.routed_experts:
            self.routed.append(_choice_rows(meta, "routed_experts", rows)[self.covered :])
        if asked.indexer_topk:
            self.indexer.append(_choice_rows(meta, "indexer_topk", rows)[self.covered :])
        self.covered = rows

    def attach(self, sample: Sample) -> None:
        if self.routed:
            sample.routed_experts = np.concatenate(self.routed)
        if self.indexer:
            sample.indexer_topk = np.concatenate(self.indexer)


def _choice_rows(meta: dict, key: str, rows: int) -> np.ndarray:
    if key not in meta:
        raise ValueError(
            f"the engine answered without meta_info[{key!r}]: start it with the flag that "
            "returns it (dsv4rl's planner adds it when the replay is on)"
        )
    return decode_rows(meta[key], rows, key)


class TrajectoryRunner:
    """Runs trajectories of one step against the engines. `env` is a `ToolEnv` (tools mode) or the
    user's environment as a `UserEnv` (env mode)."""

    def __init__(
        self,
        rollout: RolloutConfig,
        sampling: SamplingConfig,
        fmt: TurnFormat,
        env: ToolEnv | UserEnv,
        eos_id: int | None,
        choices: ChoiceRequest | None = None,
    ):
        self.cfg = rollout
        self.sampling = sampling
        self.format = fmt
        self.env = env
        self.eos_id = eos_id
        self.choices = choices or ChoiceRequest()
        self.per_turn = rollout.max_new_tokens_per_turn or sampling.max_new_tokens
        self.failure_log = FailureLog()  # the run's: each tool's first failures in full, then counts

    @property
    def call_budget(self) -> int:
        """The most calls a trajectory makes: tool calls (tools mode), environment steps (env mode)."""
        return self.env.call_budget(self.cfg)

    def step_failures(self, trajectories: int) -> StepFailures:
        """The failure count of a round of `trajectories` trajectories."""
        limit = self.cfg.max_tool_error_fraction
        return StepFailures(limit, trajectories * self.call_budget, self.failure_log)

    @staticmethod
    def _turn_seed(seed: int | None, turn: int) -> int | None:
        """The first turn samples with the sample's seed, later ones with one mixed from it."""
        if seed is None or turn == 0:
            return seed
        return mix_seed(seed, turn) % (2**31 - 1)

    def _params(self, cap: int, seed: int | None) -> dict:
        stop = ([self.eos_id] if self.eos_id is not None else []) + list(self.format.stop_ids)
        params = sampling_params(self.sampling, stop, 1, seed)
        params["max_new_tokens"] = cap
        return params

    async def _reset(self, problem: Problem) -> tuple[list[dict], Any]:
        reset = await self.env.reset(problem)
        if isinstance(reset, EnvReset):
            return list(reset.messages), (reset.state if reset.state is not None else problem)
        return list(reset), problem

    async def _close(self, state: Any) -> None:
        try:
            await self.env.close(state)
        except Exception as error:  # noqa: BLE001  (a failing close must not lose the trajectory)
            log.warning("the environment's close raised %r", error)

    async def run(
        self,
        batcher: TurnBatcher,
        problem: Problem,
        group: int,
        seed: int | None,
        failures: StepFailures | None = None,
    ) -> Sample:
        """One trajectory of `problem` (its environment state closed on every path). `failures`: the
        round's tool failures (ToolFailureError once a tool fails more than the fraction allows)."""
        failures = failures if failures is not None else self.step_failures(1)
        messages, state = await self._reset(problem)
        try:
            return await self._run(batcher, problem, group, seed, messages, state, failures)
        finally:
            await self._close(state)

    async def _run(
        self,
        batcher: TurnBatcher,
        problem: Problem,
        group: int,
        seed: int | None,
        messages: list[dict],
        state: Any,
        failures: StepFailures,
    ) -> Sample:
        rendered = self.format.encode(messages)  # the prompt: the first render (with the tool block)
        prompt = list(rendered)
        ids, mask, logprobs = list(prompt), [], []
        turns: list[TurnRecord] = []
        stitched = TurnChoices([], [])
        trajectory = Trajectory(turns=turns, messages=messages)
        finish = "stop"
        versions: list[str] = []  # per response token: the sampling version, "" where the template inserted
        while True:
            used = len(ids) - len(prompt)
            cap = min(self.per_turn, self.cfg.max_total_tokens - used)
            if cap <= 0:
                finish = "length"
                break
            turn_seed = self._turn_seed(seed, len(turns))
            output = await batcher.generate(ids, self._params(cap, turn_seed))
            meta = output["meta_info"]
            sampled = list(output["output_ids"])
            sampled_logprobs = [entry[0] for entry in meta.get("output_token_logprobs", [])]
            if len(sampled_logprobs) != len(sampled):
                raise ValueError(f"engine returned {len(sampled_logprobs)} logprobs for {len(sampled)} ids")
            versions += token_versions(meta, len(sampled))
            start = len(ids) - len(prompt)
            ids += sampled
            mask += [1.0] * len(sampled)
            logprobs += sampled_logprobs
            stitched.add(meta, len(ids) - 1, self.choices)
            reason = meta["finish_reason"]["type"]
            record = TurnRecord(start, start + len(sampled), start + len(sampled), reason)
            turns.append(record)
            if reason == "abort":
                finish = "abort"
                break
            turn = self.format.parse(sampled, len(turns) - 1, reason)
            step = await self.env.step(state, AssistantMessage(turn))
            record.calls, record.reward = step.calls, step.reward
            where = f"problem {problem.id}, turn {len(turns)}"
            aborted = step.done and step.finish == "abort"
            consequence = "the trajectory ends (abort)" if aborted else "the model got an error result"
            for name, failure in step.runs:
                if aborted and name == ENV_NAME and failure is not None:  # the environment's step raised
                    record.exception = failure.record()
                failures.ran(trajectory, name, failure, where, consequence)
            failures.check()
            for key, value in step.metrics.items():
                trajectory.metrics[key] = trajectory.metrics.get(key, 0.0) + value
            if step.done or not step.messages:  # a final answer: "length" when the cap cut it
                finish = step.finish if step.finish != "stop" else reason
                messages.append(self.format.assistant_message(turn))
                break
            if len(turns) >= self.cfg.max_turns:
                finish = "max_turns"
                messages.append(self.format.assistant_message(turn))
                break
            messages += [self.format.assistant_message(turn), *step.messages]
            try:
                new = self.format.encode(messages)
            except Exception as error:  # noqa: BLE001  (a conversation the encoder refuses ends the trajectory)
                log.warning("problem %s: the encoder refused the conversation: %s", problem.id, error)
                finish = "abort"
                break
            if new[: len(rendered)] != rendered:
                trajectory.tito_mismatches += 1
                if self.cfg.tito_check == TitoCheck.strict:
                    finish = "abort"
                    break
                log.warning(
                    "problem %s: the render of turn %d is not append-only (tito_check=warn: kept)",
                    problem.id,
                    len(turns),
                )
            inserted = self._inserted(new, len(rendered), turn, trajectory)
            if used + len(sampled) + len(inserted) >= self.cfg.max_total_tokens:
                finish = "length"  # no room left for the next turn's first token
                break
            ids += inserted
            mask += [0.0] * len(inserted)
            logprobs += [0.0] * len(inserted)
            versions += [""] * len(inserted)
            record.inserted_end = record.end + len(inserted)
            rendered = new
        self._count(trajectory, state)
        failures.release(self.call_budget - sum(c.calls for c in trajectory.by_tool.values()))
        sample = Sample(
            group=group,
            prompt_ids=prompt,
            response_ids=ids[len(prompt) :],
            rollout_logprobs=logprobs,
            response_text=self.format.decode(ids[len(prompt) :]),
            finish_reason=finish,
            answer=problem.answer,
            versions=versions,
            loss_mask=mask,
            trajectory=trajectory,
        )
        stitched.attach(sample)
        return sample

    def _inserted(self, new: list[int], start: int, turn: AssistantTurn, trajectory: Trajectory) -> list[int]:
        """What the template put after the assistant turn that starts at `start` of the new render."""
        end = self.format.assistant_end(new, start, turn)
        if new[start:end] != turn.ids:
            trajectory.retokenized_turns += 1
        tail = new[end:]
        if end > start and new[end - 1] == self.eos_id and turn.ids[-1:] != [self.eos_id]:
            tail = [self.eos_id, *tail]  # the turn was cut before its EOS: the template closes it
        return tail

    @staticmethod
    def _count(trajectory: Trajectory, state: Any) -> None:
        counts = getattr(state, "counts", None)
        if counts is None:
            return
        trajectory.tool_calls = counts.calls
        trajectory.parse_errors = counts.parse_errors
        trajectory.tool_errors = counts.errors
        trajectory.tool_timeouts = counts.timeouts
        trajectory.tool_time_s = counts.time_s


def final_turn_text(tokenizer: Any, sample: Sample) -> str:
    """The text of a sample's last assistant turn (its whole response in a single turn): what carries
    the answer a reward or an eval grades."""
    if sample.trajectory is None:
        return sample.response_text
    return tokenizer.decode(sample.final_turn_ids, skip_special_tokens=True)


async def generate_trajectories(
    clients: Sequence[EngineAPI],
    problems: Sequence[Problem],
    runner: TrajectoryRunner,
    group_size: int,
    seed: int | None = None,
    on_group: GroupHook | None = None,
    reroute: Reroute | None = None,
) -> list[Sample]:
    """`group_size` trajectories of every problem, prompt-major; each engine serves a contiguous chunk of
    the prompts (as `generate_samples` does). `on_group` gets a prompt's samples once all are done.

    `reroute` (as for `generate_samples`): a trajectory whose engine call failed is run again from its
    first turn, with a fresh environment state and the same seed, on the engine `reroute` names; the
    turns the lost engine made are dropped with it, so no trajectory is ever two engines' tokens. Its tool
    calls were made and count as made."""
    asks = runner.choices.generate_kwargs()
    failures = runner.step_failures(len(problems) * group_size)
    batchers = [TurnBatcher(client, asks) for client in clients]
    chunk = -(-len(problems) // len(clients))
    results: dict[int, list[Sample | None]] = {g: [None] * group_size for g in range(len(problems))}
    left = {g: group_size for g in range(len(problems))}

    def batcher_of(client: EngineAPI) -> TurnBatcher:
        found = next((batcher for batcher in batchers if batcher.client is client), None)
        if found is None:
            found = TurnBatcher(client, asks)
            batchers.append(found)
        return found

    async def one(group: int, index: int) -> None:
        sample_seed_ = None if seed is None else sample_seed(seed, group, index)
        batcher = batchers[group // chunk]
        while True:
            try:
                sample = await runner.run(batcher, problems[group], group, sample_seed_, failures)
                break
            except Exception as error:
                instead = await reroute(batcher.client, error) if reroute is not None else None
                if instead is None:
                    raise
                batcher = batcher_of(instead)
        results[group][index] = sample
        left[group] -= 1
        if left[group] == 0 and on_group is not None:
            on_group(group, list(results[group]))

    tasks = [asyncio.ensure_future(one(g, i)) for g in range(len(problems)) for i in range(group_size)]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # every environment closed
        runner.failure_log.flush()
        raise
    runner.failure_log.flush()
    failures.check()  # every trajectory is done: the exact fraction of each tool's calls
    return [sample for g in range(len(problems)) for sample in results[g]]


def trajectory_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """The step's tool and trajectory metrics (multi-turn samples only; empty otherwise)."""
    trajectories = [s.trajectory for s in samples if s.trajectory is not None]
    if not trajectories:
        return {}
    n = len(trajectories)
    total = sum(len(s.response_ids) for s in samples)
    inserted = sum(len(s.response_ids) - s.generated_tokens for s in samples)
    out = {
        "tool/calls_mean": sum(t.tool_calls for t in trajectories) / n,
        "tool/parse_errors": float(sum(t.parse_errors for t in trajectories)),
        "tool/errors": float(sum(t.tool_errors for t in trajectories)),
        "tool/timeouts": float(sum(t.tool_timeouts for t in trajectories)),
        "tool/time_s": sum(t.tool_time_s for t in trajectories),
        "tool/tito_mismatches": float(sum(t.tito_mismatches for t in trajectories)),
        "tool/retokenized_turns": float(sum(t.retokenized_turns for t in trajectories)),
        "turns_mean": sum(len(t.turns) for t in trajectories) / n,
        "masked_token_fraction": inserted / max(total, 1),
        "generated_len_mean": sum(s.generated_tokens for s in samples) / len(samples),
    }
    for reason in FINISH_REASONS:
        out[f"finish/{reason}"] = sum(s.finish_reason == reason for s in samples) / len(samples)
    keys = sorted({key for t in trajectories for key in t.metrics})
    for key in keys:
        out[f"tool/{key}"] = sum(t.metrics.get(key, 0.0) for t in trajectories) / n
    out["tool/exceptions"] = float(sum(t.tool_exceptions for t in trajectories))
    for name in sorted({name for t in trajectories for name in t.by_tool}):
        counts = [t.by_tool[name] for t in trajectories if name in t.by_tool]
        out[f"tool/{name}/calls"] = float(sum(c.calls for c in counts))
        out[f"tool/{name}/exceptions"] = float(sum(c.exceptions for c in counts))
        out[f"tool/{name}/timeouts"] = float(sum(c.timeouts for c in counts))
    return out
