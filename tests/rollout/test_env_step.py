"""One door into an environment: the built-in `ToolEnv` answers the public `Env.step(state,
assistant_message)` as a user's environment does (a plain OpenAI-style message included), a user's
environment sees the plain message it always saw, and the data row's old parameter name `sample` keeps
working for one release with a DeprecationWarning."""

from __future__ import annotations

import asyncio
import warnings

import pytest
from test_trajectory import CALL, EOS, PROBLEM, TOK, LookupLike, ScriptedEngine, make_runner, run, text

from dsv4rl.config.choices import RolloutMode
from dsv4rl.config.schema import RolloutConfig, SamplingConfig
from dsv4rl.rollout.env import EnvReset, EnvStep, UserEnv
from dsv4rl.rollout.trajectory import TrajectoryRunner
from dsv4rl.rollout.turn_format import AssistantMessage, AssistantTurn, ParsedCall, PlainFormat


def tool_env(**rollout):
    runner = make_runner([LookupLike()], **rollout)
    return runner.env


def call_message(*calls: tuple[str, object]) -> dict:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": f"c{k}", "type": "function", "function": {"name": name, "arguments": arguments}}
            for k, (name, arguments) in enumerate(calls)
        ],
    }


def step(env, message: dict, state=None) -> tuple[EnvStep, object]:
    async def go():
        nonlocal state
        if state is None:
            state = (await env.reset(PROBLEM)).state
        return await env.step(state, message), state

    return asyncio.run(go())


def test_tool_env_answers_a_plain_message_through_the_public_step():
    answered, state = step(tool_env(), call_message(("lookup", '{"query": "x"}'), ("lookup", {"query": "y"})))
    assert not answered.done
    assert [m["tool_call_id"] for m in answered.messages] == ["c0", "c1"]
    assert [m["content"] for m in answered.messages] == ["7", "7"]
    assert [r["arguments"] for r in answered.calls] == ['{"query": "x"}', '{"query": "y"}']
    assert [name for name, failure in answered.runs] == ["lookup", "lookup"]
    assert state.counts.calls == 2


def test_tool_env_marks_a_plain_messages_malformed_calls_without_running_them():
    answered, state = step(tool_env(), call_message(("nope", "{}"), ("lookup", "{bad"), ("lookup", "[1]")))
    errors = [m["content"] for m in answered.messages]
    assert errors[0].startswith("error: unknown tool 'nope'")
    assert errors[1].startswith("error: the arguments are not valid JSON")
    assert errors[2].startswith("error: arguments must be a JSON object, got list")  # the schema check
    assert all(record["malformed"] for record in answered.calls) and answered.runs == []
    assert state.counts.parse_errors == 3


def test_a_message_without_calls_is_the_final_answer():
    answered, _ = step(tool_env(), {"role": "assistant", "content": "7"})
    assert answered.done and answered.finish == "stop" and answered.messages == []


def test_the_rollouts_message_carries_the_parsed_turn_and_reads_as_the_plain_message():
    turn = AssistantTurn(ids=[1], text="x", content="x", calls=[ParsedCall("c0", "lookup", "{", error="bad")])
    message = AssistantMessage(turn)
    assert message == turn.message() and message.turn is turn
    answered, _ = step(tool_env(), message)
    assert answered.messages[0]["content"] == "error: bad"  # the parse's own error, not a re-read


def test_calls_on_the_last_turn_end_the_trajectory_unrun():
    env = tool_env(max_turns=2)
    first, state = step(env, call_message(("lookup", "{}")))
    last, _ = step(env, call_message(("lookup", "{}")), state)
    assert not first.done and state.counts.calls == 1
    assert last.done and last.finish == "max_turns" and last.runs == [] and state.counts.calls == 1


def test_max_turns_runs_no_call_on_the_last_turn():
    tool = LookupLike()
    sample = run(make_runner([tool], max_turns=3, max_tool_calls=10), [ScriptedEngine(lambda s: CALL)])[0]
    assert sample.finish_reason == "max_turns" and len(tool.args) == 2


class Echo:
    """A user's environment: one turn, its reward 1; keeps the messages its step received."""

    def __init__(self):
        self.seen: list = []

    async def reset(self, problem):
        return EnvReset([{"role": "user", "content": problem.prompt}], {"id": problem.id})

    async def step(self, state, assistant_message):
        self.seen.append(assistant_message)
        return EnvStep(reward=1.0, done=True)


class OldEcho(Echo):
    async def reset(self, sample):  # the parameter's name before `problem`
        return EnvReset([{"role": "user", "content": sample.prompt}], {"id": sample.id})


def env_run(env, spec: str = "game.py:Echo"):
    cfg = RolloutConfig(mode=RolloutMode.env, env=spec)
    runner = TrajectoryRunner(
        cfg, SamplingConfig(max_new_tokens=8), PlainFormat(TOK, []), UserEnv(env, spec), EOS
    )
    return run(runner, [ScriptedEngine(lambda s: "7<eos>")])[0]


def test_a_user_env_named_problem_runs_without_a_warning_and_sees_a_plain_message():
    env = Echo()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        sample = env_run(env)
    assert sample.trajectory.tool_rewards == [1.0] and text(sample.response_ids) == "7<eos>"
    assert type(env.seen[0]) is dict and env.seen[0] == {"role": "assistant", "content": "7"}


def test_a_user_env_still_naming_the_row_sample_works_and_warns():
    env = OldEcho()
    with pytest.warns(DeprecationWarning, match=r"rollout.env='game.py:Old': reset.*rename it `problem`"):
        sample = env_run(env, "game.py:Old")
    assert sample.trajectory.tool_rewards == [1.0]


class OldLookup(LookupLike):
    async def open(self, sample):  # the parameter's name before `problem`
        return await super().open(sample)


def test_a_tool_still_naming_the_row_sample_works_and_warns():
    tool = OldLookup()
    with pytest.warns(DeprecationWarning, match=r"tool 'lookup': open.*rename it `problem`"):
        runner = make_runner([tool])
    sample = run(runner, [ScriptedEngine()])[0]
    assert sample.trajectory.tool_calls == 1 and tool.args == [{"query": "1"}]


def test_a_tool_naming_the_row_problem_builds_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        make_runner([LookupLike()])
