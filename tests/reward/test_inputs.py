"""`RewardInput.from_sample`: the one place a rollout's sample and its data row become what a reward
function reads, single-turn and multi-turn."""

from __future__ import annotations

from dsv4rl.data.problems import Problem
from dsv4rl.reward.inputs import RewardInput
from dsv4rl.samples import Sample, Trajectory, TurnRecord

PROBLEM = Problem("3+4=", "7", "p3", metadata={"level": 2, "tests": [{"in": 1}]})


def test_a_single_turn_sample():
    sample = Sample(group=2, prompt_ids=[1, 5], response_ids=[7, 9], rollout_logprobs=[-0.1, -0.2],
                    response_text="<think>hm</think>7", finish_reason="length")  # fmt: skip
    got = RewardInput.from_sample(
        sample,
        PROBLEM,
        step=4,
        index=9,
        answer="7",
        reasoning="hm",
        messages=[{"role": "user", "content": "3+4="}],
    )
    assert got == RewardInput(
        prompt="3+4=", response="<think>hm</think>7", answer="7", reasoning="hm", ground_truth="7",
        metadata={"level": 2, "tests": [{"in": 1}]}, messages=[{"role": "user", "content": "3+4="}],
        prompt_ids=[1, 5], response_ids=[7, 9], finish_reason="length", step=4, index=9, group=2,
        problem_id="p3", conversation=None, turns=1, tool_calls=0, tool_rewards=[],
    )  # fmt: skip
    assert got.truncated
    got.metadata["level"] = 3  # the reward function's copy: the data row keeps its own
    assert PROBLEM.metadata["level"] == 2
    got.prompt_ids.append(0)
    assert sample.prompt_ids == [1, 5]


def test_a_multi_turn_sample():
    turns = [
        TurnRecord(0, 2, 4, "stop", reward=0.5),
        TurnRecord(4, 6, 6, "stop"),
        TurnRecord(6, 7, 7, "stop"),
    ]
    messages = [{"role": "user", "content": "3+4="}, {"role": "assistant", "content": "7"}]
    trajectory = Trajectory(turns=turns, messages=messages, tool_calls=2)
    sample = Sample(group=0, prompt_ids=[1], response_ids=list(range(7)), rollout_logprobs=[0.0] * 7,
                    response_text="1?=7 7", finish_reason="max_turns", trajectory=trajectory)  # fmt: skip
    got = RewardInput.from_sample(sample, PROBLEM, step=1, index=0, answer="7")
    assert (got.turns, got.tool_calls, got.tool_rewards) == (3, 2, [0.5])
    assert got.conversation == messages and got.conversation is not messages
    assert got.response == "1?=7 7" and got.answer == "7" and got.reasoning == "" and got.messages is None
    assert got.finish_reason == "max_turns"
