"""Multi-turn rollouts on the tiny character tokenizer (`PlainFormat`, the `?` call syntax) against a
scripted engine: budgets, tool failures and timeouts, closing every tool state, batching of turns, env
mode, the step's trajectory metrics, and the stitching of the engine's routed-expert rows over turns."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from dsv4rl.config.choices import MalformedCall, RolloutMode, TruncateSide
from dsv4rl.config.schema import RolloutConfig, SamplingConfig
from dsv4rl.data.problems import Problem
from dsv4rl.model.tokenizer import build_char_tokenizer
from dsv4rl.rollout.choices import ChoiceRequest
from dsv4rl.rollout.env import EnvReset, EnvStep, ToolEnv, UserEnv
from dsv4rl.rollout.tool_failures import ToolFailureError
from dsv4rl.rollout.trajectory import (
    TrajectoryRunner,
    TurnBatcher,
    generate_trajectories,
    trajectory_metrics,
)
from dsv4rl.rollout.turn_format import PLAIN_CALL, PLAIN_NAME_END, PLAIN_RESULT, PlainFormat
from dsv4rl.samples import Sample, Trajectory, TurnRecord
from dsv4rl.tools.base import FunctionTool, ToolResult
from dsv4rl.wire.choices import encode_int32

TOK = build_char_tokenizer()
BOS, EOS = TOK.bos_token_id, TOK.eos_token_id
PROBLEM = Problem("Q:", "7", "p0")
CALL, ANSWER = f"1{PLAIN_CALL}", "7<eos>"  # a call to the one tool with argument "1"; the final answer


def result(text: str) -> str:
    """A tool result as PlainFormat writes it after the call."""
    return f"{PLAIN_RESULT}{text}"


L = len(CALL)  # the tokens of a call turn (one character a token)
R = len(result("7"))  # the tokens inserted after a call answered "7"


def ids(text: str) -> list[int]:
    return list(TOK(text, add_special_tokens=False)["input_ids"])


def text(token_ids: list[int]) -> str:
    return TOK.decode(token_ids, skip_special_tokens=False)


def logprob(position: int) -> float:
    """The scripted engine's log-prob of the token it samples at `position` of the sequence."""
    return -0.001 * (position + 1)


def call_then_answer(seen: str) -> str:
    """A model that calls the tool first and answers once a result (`=...`) is in its input."""
    return ANSWER if PLAIN_RESULT in seen else CALL


class ScriptedEngine:
    """An EngineAPI whose turns are scripted: `reply(input text)` is the text it samples (or `(text,
    finish type)`), cut after the first stop token and at `max_new_tokens` (finish "length") as an engine
    does. Every generate call's
    inputs, sampling params and keyword asks are kept. Asked for routed experts / indexer top-k, each
    request answers rows for its prompt + output - 1 positions: row j = [1000 * request number + j, j]."""

    def __init__(self, reply: Callable[[str], str | tuple[str, str]] = call_then_answer):
        self.reply = reply
        self.calls: list[tuple[list[list[int]], list[dict], dict]] = []
        self.requests = 0

    @property
    def inputs(self) -> list[list[int]]:
        return [i for inputs, _, _ in self.calls for i in inputs]

    @property
    def params(self) -> list[dict]:
        return [p for _, params, _ in self.calls for p in params]

    async def generate(self, input_ids, sampling_params, return_logprob=False, **asks):
        assert return_logprob
        self.calls.append(([list(i) for i in input_ids], [dict(p) for p in sampling_params], dict(asks)))
        outputs = []
        for prompt, params in zip(input_ids, sampling_params, strict=True):
            reply = self.reply(text(prompt))
            said, finish = reply if isinstance(reply, tuple) else (reply, "stop")
            out = ids(said)
            stops = [k for k, t in enumerate(out) if t in params["stop_token_ids"]]
            if stops:  # the engine stops at a stop token (EOS, the plain call marker), keeping it
                out = out[: stops[0] + 1]
            if len(out) > params["max_new_tokens"]:
                out, finish = out[: params["max_new_tokens"]], "length"
            meta = {
                "output_token_logprobs": [[logprob(len(prompt) + k), t, None] for k, t in enumerate(out)],
                "finish_reason": {"type": finish},
                "weight_version": "3",
            }
            positions = np.arange(len(prompt) + len(out) - 1)
            if asks.get("return_routed_experts"):
                meta["routed_experts"] = encode_int32(
                    np.stack([1000 * self.requests + positions, positions], 1)
                )
            if asks.get("return_indexer_topk"):
                meta["indexer_topk"] = encode_int32(
                    np.stack([1000 * self.requests + positions, -positions, positions * 0 + 5], 1)
                )
            self.requests += 1
            outputs.append({"output_ids": out, "meta_info": meta})
        return outputs


class LookupLike:
    """The one tool (`lookup`, a string argument `query`): answers `answer`, or runs `behavior(args)`;
    counts the states it opened and closed."""

    name = "lookup"
    schema = {
        "name": "lookup",
        "description": "Look the value up.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": []},
    }

    def __init__(self, answer: str = "7", behavior=None):
        self.answer = answer
        self.behavior = behavior
        self.opened: list[int] = []
        self.closed: list[int] = []
        self.args: list[dict] = []

    async def open(self, problem):
        state = len(self.opened)
        self.opened.append(state)
        return state

    async def call(self, state, args):
        assert state in self.opened and state not in self.closed
        self.args.append(args)
        if self.behavior is not None:
            return await self.behavior(args)
        return ToolResult(text=self.answer)

    async def close(self, state):
        self.closed.append(state)

    def assert_closed_once(self, opened: int | None = None) -> None:
        if opened is not None:
            assert len(self.opened) == opened
        assert sorted(self.closed) == sorted(self.opened), (self.opened, self.closed)


def make_runner(tools=None, timeouts=None, sampling=None, choices=None, **rollout) -> TrajectoryRunner:
    tools = [LookupLike()] if tools is None else tools
    cfg = RolloutConfig(mode=RolloutMode.tools, **rollout)
    fmt = PlainFormat(TOK, [tool.schema for tool in tools])
    timeouts = timeouts or {tool.name: 5.0 for tool in tools}
    env = ToolEnv(tools, timeouts, cfg, fmt, asyncio.Semaphore(cfg.max_concurrent_tools))
    return TrajectoryRunner(cfg, sampling or SamplingConfig(max_new_tokens=16), fmt, env, EOS, choices)


def run(runner, engines, problems=(PROBLEM,), group_size: int = 1) -> list[Sample]:
    return asyncio.run(generate_trajectories(list(engines), list(problems), runner, group_size))


def run_one(runner, engine=None) -> tuple[Sample, ScriptedEngine]:
    engine = engine or ScriptedEngine()
    return run(runner, [engine])[0], engine


# --- a trajectory: ids, mask, log-probs ---------------------------------------------------------------------


class UpdatedMidAnswer(ScriptedEngine):
    """The first turn sampled by version "2"; the second continued across an update: its first token by
    "2", the rest by "3" (the spans SGLang returns after an in-place pause)."""

    async def generate(self, input_ids, sampling_params, return_logprob=False, **asks):
        outputs = await super().generate(input_ids, sampling_params, return_logprob, **asks)
        for output in outputs:
            n, meta = len(output["output_ids"]), output["meta_info"]
            first = self.requests == 1
            meta["weight_versions"] = (
                [{"version": "2", "start": 0, "end": n}]
                if first
                else [{"version": "2", "start": 0, "end": 1}, {"version": "3", "start": 1, "end": n}]
            )
        return outputs


def test_each_token_keeps_the_version_that_sampled_it():
    sample, _ = run_one(make_runner(), UpdatedMidAnswer())
    assert sample.versions == ["2"] * L + [""] * R + ["2", "3"]  # inserted tokens: no version
    assert sample.weight_version == "2"  # its head: the oldest policy it came from


def test_call_result_answer_tokens_mask_and_logprobs():
    tool = LookupLike()
    sample, engine = run_one(make_runner([tool]))
    assert sample.prompt_ids == [BOS, *ids("Q:")]
    assert text(sample.response_ids) == CALL + result("7") + ANSWER
    assert sample.loss_mask == [1] * L + [0] * R + [1, 1]
    full = sample.prompt_ids + sample.response_ids
    expected = [logprob(len(sample.prompt_ids) + k) if m else 0.0 for k, m in enumerate(sample.loss_mask)]
    assert sample.rollout_logprobs == pytest.approx(expected)
    assert engine.inputs == [sample.prompt_ids, full[:-2]]  # turn 2 sees the result the template inserted
    assert all(p["stop_token_ids"] == [EOS, *ids(PLAIN_CALL)] for p in engine.params)
    assert tool.args == [{"query": "1"}]
    assert sample.finish_reason == "stop" and sample.weight_version == "3"
    assert sample.final_turn_ids == ids(ANSWER) and sample.generated_tokens == L + 2
    traj = sample.trajectory
    assert [(t.start, t.end, t.inserted_end) for t in traj.turns] == [
        (0, L, L + R),
        (L + R, L + R + 2, L + R + 2),
    ]
    assert traj.turns[0].calls[0]["result"] == "7" and traj.tool_calls == 1
    assert traj.messages[-1]["content"] == "7" and traj.retokenized_turns == 0
    tool.assert_closed_once(1)


# --- budgets ------------------------------------------------------------------------------------------------


def test_max_turns_ends_with_max_turns():
    tool = LookupLike()
    sample, engine = run_one(
        make_runner([tool], max_turns=3, max_tool_calls=10), ScriptedEngine(lambda s: CALL)
    )
    assert sample.finish_reason == "max_turns"
    assert len(engine.inputs) == 3 and len(sample.trajectory.turns) == 3
    assert text(sample.final_turn_ids) == CALL
    assert text(sample.response_ids).endswith(CALL)  # nothing inserted after the last turn
    assert sample.loss_mask[-L:] == [1] * L
    tool.assert_closed_once(1)


def test_max_tool_calls_ends_with_tool_budget():
    tool = LookupLike()
    runner = make_runner([tool], max_turns=5, max_tool_calls=1)
    sample, engine = run_one(runner, ScriptedEngine(lambda s: CALL))
    assert sample.finish_reason == "tool_budget"
    assert len(engine.inputs) == 2 and len(tool.args) == 1  # the second turn's call is not run
    assert sample.trajectory.tool_calls == 1
    tool.assert_closed_once(1)


@pytest.mark.parametrize(
    ("per_turn", "sampling_cap", "left", "expected_caps"),
    [
        (5, 99, 2, [5, 2]),  # turn 2 may take only what is left after L sampled + R inserted
        (5, 99, 100, [5, 5]),
        (None, 4, 100, [4, 4]),  # no per-turn cap: algo.sampling.max_new_tokens
        (None, 4, 1, [4, 1]),
    ],
)
def test_max_new_tokens_per_turn_clamped_to_what_is_left(per_turn, sampling_cap, left, expected_caps):
    total = L + R + left
    runner = make_runner(
        max_new_tokens_per_turn=per_turn,
        max_total_tokens=total,
        sampling=SamplingConfig(max_new_tokens=sampling_cap),
    )
    sample, engine = run_one(runner, ScriptedEngine(lambda s: "7" if PLAIN_RESULT in s else CALL))
    assert [p["max_new_tokens"] for p in engine.params] == expected_caps
    assert len(sample.response_ids) <= total


def test_max_total_tokens_reached_by_the_inserted_result():
    tool = LookupLike()
    sample, engine = run_one(make_runner([tool], max_total_tokens=L + R))
    assert sample.finish_reason == "length"
    assert len(engine.inputs) == 1  # L sampled + R inserted leave no room for a next turn
    assert text(sample.response_ids) == CALL and sample.loss_mask == [1] * L
    assert len(sample.rollout_logprobs) == len(sample.response_ids)
    tool.assert_closed_once(1)


def test_max_total_tokens_reached_inside_a_turn():
    runner = make_runner(max_new_tokens_per_turn=4, max_total_tokens=L + R + 2)
    sample, engine = run_one(runner, ScriptedEngine(lambda s: "7777<eos>" if PLAIN_RESULT in s else CALL))
    assert sample.finish_reason == "length"
    assert [p["max_new_tokens"] for p in engine.params] == [4, 2]
    assert text(sample.response_ids) == CALL + result("7") + "77"
    assert len(sample.response_ids) == L + R + 2 and sample.loss_mask[-2:] == [1, 1]
    assert sample.trajectory.turns[-1].finish_reason == "length"


@pytest.mark.parametrize(
    ("side", "kept"),
    [(TruncateSide.left, "0123"), (TruncateSide.right, "6789"), (TruncateSide.middle, "0189")],
)
def test_tool_output_truncated_on_each_side(side, kept):
    tool = LookupLike(answer="0123456789")
    sample, engine = run_one(make_runner([tool], max_tool_output_tokens=4, truncate_side=side))
    assert text(engine.inputs[1]).endswith(CALL + result(kept))
    assert sample.trajectory.turns[0].calls[0]["result"] == kept
    assert sample.finish_reason == "stop"


def test_tool_output_within_the_limit_is_kept_whole():
    tool = LookupLike(answer="0123")
    _, engine = run_one(make_runner([tool], max_tool_output_tokens=4, truncate_side=TruncateSide.middle))
    assert text(engine.inputs[1]).endswith(result("0123"))


# --- tool failures ------------------------------------------------------------------------------------------


def test_a_tool_that_raises_is_an_error_result_and_the_step_goes_on():
    async def boom(args):
        raise RuntimeError("boom")

    tool = LookupLike(behavior=boom)  # under a fraction that tolerates it (test_tool_failures.py: the limit)
    sample, engine = run_one(make_runner([tool], max_tool_error_fraction=1.0))
    record = sample.trajectory.turns[0].calls[0]
    assert record["error"] and record["result"] == "error: RuntimeError: boom"
    assert not record["timed_out"]
    assert len(engine.inputs) == 2 and sample.finish_reason == "stop"
    traj = sample.trajectory
    assert (traj.tool_errors, traj.tool_timeouts, traj.tool_calls, traj.parse_errors) == (1, 0, 1, 0)
    tool.assert_closed_once(1)


def test_an_async_tool_that_hangs_times_out():
    async def hang(args):
        await asyncio.sleep(30)

    tool = LookupLike(behavior=hang)
    began = time.monotonic()
    sample, engine = run_one(make_runner([tool], timeouts={"lookup": 0.2}, max_tool_error_fraction=1.0))
    assert time.monotonic() - began < 5
    record = sample.trajectory.turns[0].calls[0]
    assert record["timed_out"] and record["result"] == "error: the call timed out after 0.2 s"
    assert 0.15 < record["time_s"] < 5
    assert len(engine.inputs) == 2 and sample.finish_reason == "stop"
    assert (sample.trajectory.tool_timeouts, sample.trajectory.tool_errors) == (1, 1)
    tool.assert_closed_once(1)


def test_a_sync_function_tool_that_hangs_times_out():
    release = threading.Event()

    def lookup(query: str = "") -> str:
        release.wait(10)
        return "7"

    engine = ScriptedEngine()
    runner = make_runner([FunctionTool(lookup)], timeouts={"lookup": 0.2}, max_tool_error_fraction=1.0)

    async def go():
        began = time.monotonic()
        try:
            return await generate_trajectories([engine], [PROBLEM], runner, 1), time.monotonic() - began
        finally:
            release.set()  # the thread of a timed-out sync function cannot be killed: let it finish

    (sample,), seconds = asyncio.run(go())
    assert seconds < 5
    assert sample.trajectory.tool_timeouts == 1 and sample.finish_reason == "stop"
    assert len(engine.inputs) == 2


class Other(LookupLike):
    name = "other"
    schema = {**LookupLike.schema, "name": "other"}


def test_malformed_plain_call_feedback_and_terminate():
    unknown = f"5{PLAIN_NAME_END}1{PLAIN_CALL}"  # with two tools a call names one: "5" is none of them
    tools = [LookupLike(), Other()]
    engine = ScriptedEngine(lambda s: ANSWER if PLAIN_RESULT in s else unknown)
    sample, _ = run_one(make_runner(tools), engine)
    assert sample.trajectory.parse_errors == 1 and sample.finish_reason == "stop"
    record = sample.trajectory.turns[0].calls[0]
    assert record["malformed"] and record["result"] == "error: unknown tool '5'; tools: lookup, other"
    assert len(engine.inputs) == 2 and tools[0].args == [] and tools[1].args == []
    engine = ScriptedEngine(lambda s: ANSWER if PLAIN_RESULT in s else unknown)
    sample, _ = run_one(make_runner(tools, on_malformed_call=MalformedCall.terminate), engine)
    assert sample.finish_reason == "abort" and sample.trajectory.parse_errors == 1
    assert len(engine.inputs) == 1


# --- every tool state closed exactly once -------------------------------------------------------------------


class RaisingEngine(ScriptedEngine):
    def __init__(self, fail_at: int):
        super().__init__()
        self.fail_at = fail_at

    async def generate(self, input_ids, sampling_params, return_logprob=False, **asks):
        if len(self.calls) == self.fail_at:
            self.calls.append((input_ids, sampling_params, asks))
            raise RuntimeError("engine down")
        return await super().generate(input_ids, sampling_params, return_logprob, **asks)


class HangingEngine(ScriptedEngine):
    """Answers the first turn; every later generate call waits forever."""

    def __init__(self, answer_first: bool = True):
        super().__init__()
        self.answer_first = answer_first
        self.waiting = asyncio.Event()

    async def generate(self, input_ids, sampling_params, return_logprob=False, **asks):
        if self.answer_first and not self.calls:
            return await super().generate(input_ids, sampling_params, return_logprob, **asks)
        self.calls.append((input_ids, sampling_params, asks))
        self.waiting.set()
        await asyncio.Event().wait()


def test_states_closed_once_on_success_error_and_abort():
    ok = LookupLike()
    run(make_runner([ok]), [ScriptedEngine()], [PROBLEM, PROBLEM], group_size=2)
    ok.assert_closed_once(4)

    async def boom(args):
        raise ValueError("bad")

    failing = LookupLike(behavior=boom)
    run(make_runner([failing], max_tool_error_fraction=1.0), [ScriptedEngine()], group_size=3)
    failing.assert_closed_once(3)
    stopped = LookupLike(behavior=boom)  # the failures stop the round: every state still closed once
    with pytest.raises(ToolFailureError):
        run(make_runner([stopped]), [ScriptedEngine()], group_size=3)
    stopped.assert_closed_once(3)

    aborting = LookupLike()
    engine = ScriptedEngine(lambda s: ("7", "abort") if PLAIN_RESULT in s else CALL)
    samples = run(make_runner([aborting]), [engine], group_size=2)
    assert [s.finish_reason for s in samples] == ["abort", "abort"]
    aborting.assert_closed_once(2)


def test_states_closed_once_when_the_engine_raises():
    tool = LookupLike()
    with pytest.raises(RuntimeError, match="engine down"):
        run(make_runner([tool]), [RaisingEngine(fail_at=1)], [PROBLEM, PROBLEM], group_size=2)
    tool.assert_closed_once(4)


def test_a_trajectory_whose_engine_is_lost_runs_again_whole_on_a_live_one():
    """Engine 0 fails the second turn of its trajectories: each is run again from its first turn, with a
    fresh tool state, on the engine the reroute names. The samples are the ones two healthy engines give:
    no trajectory keeps a turn of the lost engine."""
    healthy = run(make_runner([LookupLike()]), [ScriptedEngine(), ScriptedEngine()], [PROBLEM, PROBLEM], 2)
    tool = LookupLike()
    broken, live = RaisingEngine(fail_at=1), ScriptedEngine()
    rerouted = []

    async def reroute(client, error):
        rerouted.append(str(error))
        return live if client is broken else None

    runner = make_runner([tool])
    samples = asyncio.run(
        generate_trajectories([broken, live], [PROBLEM, PROBLEM], runner, 2, reroute=reroute)
    )
    assert rerouted == ["engine down", "engine down"]  # group 0's two trajectories, whose turns were batched
    assert len(broken.calls) == 2 and len(live.calls) >= 2
    assert [(s.group, s.response_ids, s.loss_mask, s.rollout_logprobs) for s in samples] == [
        (s.group, s.response_ids, s.loss_mask, s.rollout_logprobs) for s in healthy
    ]
    tool.assert_closed_once(6)  # group 0's first states, closed when their engine failed, and the rest


def test_a_trajectory_error_that_the_reroute_declines_is_raised():
    async def declines(client, error):
        return None

    with pytest.raises(RuntimeError, match="engine down"):
        asyncio.run(
            generate_trajectories([RaisingEngine(fail_at=0)], [PROBLEM], make_runner(), 1, reroute=declines)
        )


def test_states_closed_once_when_one_engine_raises_and_another_hangs():
    tool = LookupLike()
    engines = [RaisingEngine(fail_at=0), HangingEngine(answer_first=False)]
    with pytest.raises(RuntimeError, match="engine down"):
        run(make_runner([tool]), engines, [PROBLEM, PROBLEM], group_size=2)
    tool.assert_closed_once(4)


@pytest.mark.parametrize("where", ["engine", "tool"])
def test_states_closed_once_on_cancellation(where):
    """Cancelled while a turn waits on the engine, or while a tool call runs: every state closed once."""
    in_tool = asyncio.Event()

    async def hang(args):
        in_tool.set()
        await asyncio.sleep(30)

    tool = LookupLike(behavior=hang if where == "tool" else None)
    engine = HangingEngine(answer_first=where == "tool")
    runner = make_runner([tool], timeouts={"lookup": 60.0})

    async def go():
        task = asyncio.ensure_future(generate_trajectories([engine], [PROBLEM, PROBLEM], runner, 2))
        await (in_tool.wait() if where == "tool" else engine.waiting.wait())
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    tool.assert_closed_once(4)


def test_a_failing_open_closes_what_was_opened():
    class BrokenOpen(LookupLike):
        name = "broken"
        schema = {**LookupLike.schema, "name": "broken"}

        async def open(self, problem):
            raise OSError("no sandbox")

    good = LookupLike()
    with pytest.raises(OSError, match="no sandbox"):
        run(make_runner([good, BrokenOpen()]), [ScriptedEngine()])
    good.assert_closed_once(1)


def test_a_failing_close_does_not_lose_the_trajectory():
    class BrokenClose(LookupLike):
        async def close(self, state):
            await super().close(state)
            raise OSError("cleanup failed")

    tool = BrokenClose()
    sample, _ = run_one(make_runner([tool]))
    assert sample.finish_reason == "stop"
    tool.assert_closed_once(1)


# --- batching -----------------------------------------------------------------------------------------------


def test_concurrent_turns_go_out_as_one_batched_generate():
    problems = [Problem("Q:", "7", f"p{i}") for i in range(3)]
    engine = ScriptedEngine()
    samples = run(make_runner(), [engine], problems, group_size=2)
    assert [len(inputs) for inputs, _, _ in engine.calls] == [6, 6]  # two turns, six trajectories each
    assert [s.group for s in samples] == [0, 0, 1, 1, 2, 2]
    assert all(text(s.response_ids) == CALL + result("7") + ANSWER for s in samples)


def test_each_engine_batches_its_chunk_of_the_prompts():
    problems = [Problem("Q:", "7", f"p{i}") for i in range(3)]
    engines = [ScriptedEngine(), ScriptedEngine()]
    samples = run(make_runner(), engines, problems, group_size=2)
    assert [len(inputs) for inputs, _, _ in engines[0].calls] == [4, 4]  # prompts 0 and 1
    assert [len(inputs) for inputs, _, _ in engines[1].calls] == [2, 2]  # prompt 2
    assert len(samples) == 6


def test_batcher_refuses_an_answer_of_the_wrong_length():
    class Short(ScriptedEngine):
        async def generate(self, input_ids, sampling_params, return_logprob=False, **asks):
            return (await super().generate(input_ids, sampling_params, return_logprob, **asks))[:1]

    async def go():
        batcher = TurnBatcher(Short(), {})
        params = {"max_new_tokens": 4, "stop_token_ids": [EOS]}
        return await asyncio.gather(
            batcher.generate(ids("Q:"), params), batcher.generate(ids("Q:"), params), return_exceptions=True
        )

    results = asyncio.run(go())
    assert all(isinstance(r, ValueError) and "1 outputs for 2 turns" in str(r) for r in results)


# --- env mode -----------------------------------------------------------------------------------------------


class TwoTurnEnv:
    """An environment: hints `=3.` after the first turn (reward 0.25), done after the second (reward 1)."""

    def __init__(self):
        self.seen: list[dict] = []
        self.closed: list[str] = []

    async def reset(self, problem):
        return EnvReset([{"role": "user", "content": problem.prompt}], {"id": problem.id, "turn": 0})

    async def step(self, state, assistant_message):
        self.seen.append(assistant_message)
        state["turn"] += 1
        if state["turn"] == 1:
            return EnvStep(messages=[{"role": "user", "content": "=3."}], reward=0.25, metrics={"hint": 1.0})
        return {"reward": 1.0, "done": True}  # a plain dict is taken as EnvStep(**dict)

    async def close(self, state):
        self.closed.append(state["id"])


def test_env_mode_two_turns_with_per_turn_rewards():
    env = TwoTurnEnv()
    cfg = RolloutConfig(mode=RolloutMode.env)
    fmt = PlainFormat(TOK, [])
    runner = TrajectoryRunner(cfg, SamplingConfig(max_new_tokens=8), fmt, UserEnv(env, "game.py:Env"), EOS)
    engine = ScriptedEngine(lambda s: "3<eos>" if "=" in s else "1<eos>")
    sample = run(runner, [engine])[0]
    assert text(sample.response_ids) == "1<eos>=3.3<eos>"
    assert sample.loss_mask == [1, 1, 0, 0, 0, 1, 1]
    assert sample.trajectory.tool_rewards == [0.25, 1.0]
    assert [t.reward for t in sample.trajectory.turns] == [0.25, 1.0]
    assert sample.finish_reason == "stop" and sample.trajectory.metrics == {"hint": 1.0}
    assert [m["content"] for m in env.seen] == ["1", "3"]
    assert env.closed == ["p0"]
    assert trajectory_metrics([sample])["tool/hint"] == 1.0


# --- metrics ------------------------------------------------------------------------------------------------


def _sample(mask, finish, turns, **counts) -> Sample:
    records = [TurnRecord(0, 1, 1, "stop") for _ in range(turns)]
    metrics = counts.pop("metrics", {})
    return Sample(
        group=0,
        prompt_ids=[BOS],
        response_ids=[5] * len(mask),
        rollout_logprobs=[0.0] * len(mask),
        response_text="",
        finish_reason=finish,
        loss_mask=list(mask),
        trajectory=Trajectory(records, [], metrics=metrics, **counts),
    )


def test_trajectory_metrics():
    samples = [
        _sample([1, 1, 1, 0, 0, 0, 1, 1], "stop", 2, tool_calls=1, tool_time_s=0.5, metrics={"hits": 2.0}),
        _sample([1, 1, 1], "length", 1, tool_timeouts=1, tool_errors=1, tito_mismatches=1),
        _sample([1, 0, 1, 0], "tool_budget", 3, tool_calls=2, parse_errors=2, retokenized_turns=1),
        _sample([1], "stop", 1),
    ]
    out = trajectory_metrics(samples)
    assert out["tool/calls_mean"] == pytest.approx(3 / 4)
    assert out["turns_mean"] == pytest.approx(7 / 4)
    assert out["masked_token_fraction"] == pytest.approx(5 / 16)
    assert out["generated_len_mean"] == pytest.approx(11 / 4)
    assert out["finish/stop"] == 0.5 and out["finish/length"] == 0.25 and out["finish/tool_budget"] == 0.25
    assert out["finish/abort"] == 0.0 and out["finish/max_turns"] == 0.0
    assert (out["tool/parse_errors"], out["tool/errors"], out["tool/timeouts"]) == (2.0, 1.0, 1.0)
    assert (out["tool/tito_mismatches"], out["tool/retokenized_turns"]) == (1.0, 1.0)
    assert out["tool/time_s"] == pytest.approx(0.5)
    assert out["tool/hits"] == pytest.approx(0.5)  # averaged over trajectories
    assert trajectory_metrics([]) == {}


def test_trajectory_metrics_of_real_rollouts():
    samples = run(make_runner(), [ScriptedEngine()], group_size=2)
    out = trajectory_metrics(samples)
    assert out["tool/calls_mean"] == 1.0 and out["turns_mean"] == 2.0 and out["finish/stop"] == 1.0
    assert out["masked_token_fraction"] == pytest.approx(R / (L + R + 2))


# --- routed experts / indexer top-k stitched over turns -----------------------------------------------------


@pytest.mark.parametrize(
    ("total", "reply", "inputs"),
    [
        (100, call_then_answer, [3, 3 + L + R]),  # prompt 3; call L + result R; answer 2
        (100, lambda s: ANSWER if s.count(PLAIN_RESULT) >= 2 else CALL, [3, 3 + L + R, 3 + 2 * (L + R)]),
        (L + R, call_then_answer, [3]),  # the result would exhaust the budget: not appended, no row for it
    ],
)
def test_routed_experts_rows_come_from_the_first_call_that_forwarded_them(total, reply, inputs):
    runner = make_runner(
        max_total_tokens=total, choices=ChoiceRequest(routed_experts=True, indexer_topk=True)
    )
    sample, engine = run_one(runner, ScriptedEngine(reply))
    assert all(
        asks == {"return_routed_experts": True, "return_indexer_topk": True} for *_, asks in engine.calls
    )
    rows = len(sample.prompt_ids) + len(sample.response_ids) - 1
    routed, indexer = sample.routed_experts, sample.indexer_topk
    assert routed.shape == (rows, 2) and indexer.shape == (rows, 3)
    assert routed.dtype == np.int32
    # request r forwarded positions [0, len(input r) + len(output r) - 1): a position's row comes from the
    # first request whose range holds it
    assert [len(i) for i in engine.inputs] == inputs
    ends = [len(inp) + len(out) - 1 for inp, out in zip(engine.inputs, _outputs(sample), strict=True)]
    expected_request = np.searchsorted(np.array(ends), np.arange(rows), side="right")
    assert list(routed[:, 1]) == list(range(rows))
    assert list(routed[:, 0] // 1000) == list(expected_request)
    assert list(indexer[:, 0]) == list(routed[:, 0]) and list(indexer[:, 1]) == list(-routed[:, 1])
    if len(inputs) > 1:  # a turn's last token and the inserted tokens: from the next turn's prefill
        first_end = ends[0]
        assert routed[first_end - 1, 0] // 1000 == 0 and routed[first_end, 0] // 1000 == 1


def _outputs(sample: Sample) -> list[list[int]]:
    turns = sample.trajectory.turns
    return [sample.response_ids[t.start : t.end] for t in turns]


def test_routed_experts_missing_from_the_answer_names_the_flag():
    class NoRows(ScriptedEngine):
        async def generate(self, input_ids, sampling_params, return_logprob=False, **asks):
            return await super().generate(input_ids, sampling_params, return_logprob)

    runner = make_runner(choices=ChoiceRequest(routed_experts=True))
    with pytest.raises(ValueError, match="routed_experts"):
        run_one(runner, NoRows())
