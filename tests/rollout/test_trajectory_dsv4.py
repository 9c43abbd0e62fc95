"""Multi-turn tool use on DeepSeek-V4's tokenizer and DSML (`DsmlFormat` through deepseek-recipe), and in
V4.1's format: a trajectory built turn by turn from the engine's tokens is deepseek-recipe's encoding of
the same conversation, the loss mask covers exactly the sampled tokens, malformed calls come back as
error results, and a render that is not append-only is caught (`rollout.tito_check`)."""

from __future__ import annotations

import asyncio

import pytest

from dsv4rl.config.choices import ChatFormat, MalformedCall, ReasoningEffort, RolloutMode, TitoCheck
from dsv4rl.config.schema import RolloutConfig, SamplingConfig
from dsv4rl.data.chat_format import ChatSettings, PromptRenderer
from dsv4rl.data.problems import Problem
from dsv4rl.model.tokenizer import deepseek_v4_tokenizer
from dsv4rl.rollout.env import ToolEnv
from dsv4rl.rollout.trajectory import TrajectoryRunner, generate_trajectories
from dsv4rl.rollout.turn_format import DsmlFormat
from dsv4rl.tools.base import ToolResult
from v41_tokenizer import dsv41_tokenizer

SCHEMA = {
    "name": "python",
    "description": "Run Python code and get what it prints.",
    "parameters": {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "The code to run."}},
        "required": ["code"],
    },
}
QUESTION = "What is 6*7? Check with python."
ARGUMENTS = '{"code": "print(6*7)"}'
TOOL_OUTPUT = "42\n"
PROBLEM = Problem(QUESTION, "42", "six-times-seven")


def conversation(final: bool = True) -> list[dict]:
    """The reference conversation: thinking and a python call, its result, thinking and the answer."""
    messages = [
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "I should compute it with the tool.",
            "tool_calls": [
                {"id": "x", "type": "function", "function": {"name": "python", "arguments": ARGUMENTS}}
            ],
        },
        {"role": "tool", "tool_call_id": "x", "content": TOOL_OUTPUT},
    ]
    if final:
        messages.append(
            {"role": "assistant", "content": "The answer is 42.", "reasoning_content": "The tool printed 42."}
        )
    return messages


class Reference:
    """deepseek-recipe's encodings of the conversation after each turn, and the assistant turns' tokens as
    the encoder writes them (what the scripted engine samples)."""

    def __init__(self, renderer: PromptRenderer):
        self.renderer = renderer
        self.tok = renderer.tokenizer
        self.eos = self.tok.eos_token_id
        encode = renderer.encode_messages
        self.prompt = encode(conversation()[:1])
        self.after_call = encode(conversation(final=False))
        self.full = encode(conversation())
        assert self.after_call[: len(self.prompt)] == self.prompt  # the encoder is append-only here
        assert self.full[: len(self.after_call)] == self.after_call
        self.call_turn = self._turn(self.after_call, len(self.prompt))
        self.answer_turn = self._turn(self.full, len(self.after_call))
        self.inserted = self.after_call[len(self.prompt) + len(self.call_turn) :]

    def _turn(self, ids: list[int], start: int) -> list[int]:
        return ids[start : ids.index(self.eos, start) + 1]

    def ids(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def text(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)


@pytest.fixture(scope="module")
def ref() -> Reference:
    settings = ChatSettings(ChatFormat.deepseek_v4, thinking=True, reasoning_effort=ReasoningEffort.high)
    return Reference(PromptRenderer(deepseek_v4_tokenizer(), settings, tools=[SCHEMA]))


def logprob(request: int, k: int) -> float:
    return -0.01 * (request + 1) - 0.0001 * k


class ScriptedEngine:
    """An EngineAPI that samples `turns[n]` for its n-th request; keeps every input."""

    def __init__(self, turns: list[list[int]]):
        self.turns = turns
        self.inputs: list[list[int]] = []
        self.sampled: list[list[float]] = []

    async def generate(self, input_ids, sampling_params, return_logprob=False, **asks):
        outputs = []
        for ids in input_ids:
            n = len(self.inputs)
            self.inputs.append(list(ids))
            out = self.turns[n]
            self.sampled.append([logprob(n, k) for k in range(len(out))])
            outputs.append(
                {
                    "output_ids": list(out),
                    "meta_info": {
                        "output_token_logprobs": [
                            [lp, t, None] for lp, t in zip(self.sampled[-1], out, strict=True)
                        ],
                        "finish_reason": {"type": "stop"},
                        "weight_version": "0",
                    },
                }
            )
        return outputs


class FakePython:
    name = "python"
    schema = SCHEMA

    def __init__(self):
        self.args: list[dict] = []
        self.opened = self.closed = 0

    async def open(self, problem):
        self.opened += 1
        return {}

    async def call(self, state, args):
        self.args.append(args)
        return ToolResult(text=TOOL_OUTPUT)

    async def close(self, state):
        self.closed += 1


def make_runner(ref: Reference, tool: FakePython, **rollout) -> TrajectoryRunner:
    cfg = RolloutConfig(mode=RolloutMode.tools, max_total_tokens=4096, **rollout)
    fmt = DsmlFormat(ref.renderer)
    env = ToolEnv([tool], {"python": 5.0}, cfg, fmt, asyncio.Semaphore(4))
    return TrajectoryRunner(cfg, SamplingConfig(max_new_tokens=512), fmt, env, ref.eos)


def run(runner: TrajectoryRunner, engine: ScriptedEngine):
    return asyncio.run(generate_trajectories([engine], [PROBLEM], runner, 1))[0]


def test_three_turn_trajectory_is_the_reference_encoding(ref):
    check_three_turns(ref)


def test_in_v41s_format_the_trajectory_is_v41s_reference_encoding():
    """The same three turns in DeepSeek-V4.1's format (`<｜DSML｜ calls>` tags, the effort line in a system
    turn), on a tokenizer with V4.1's `<｜System｜>`: still deepseek-recipe's encoding, append-only."""
    settings = ChatSettings(ChatFormat.deepseek_v41, thinking=True, reasoning_effort=ReasoningEffort.high)
    ref41 = Reference(PromptRenderer(dsv41_tokenizer(), settings, tools=[SCHEMA]))
    assert "<｜DSML｜ calls>" in ref41.text(ref41.call_turn)
    check_three_turns(ref41)


def check_three_turns(ref: Reference) -> None:
    tool = FakePython()
    engine = ScriptedEngine([ref.call_turn, ref.answer_turn])
    sample = run(make_runner(ref, tool), engine)

    full = sample.prompt_ids + sample.response_ids
    assert sample.prompt_ids == ref.prompt
    assert full == ref.full[: len(full)]
    assert ref.text(ref.full[len(full) :]) == "<｜Assistant｜><think>"  # the encoder's next-turn opener
    assert full[-1] == ref.eos and sample.finish_reason == "stop"
    assert engine.inputs == [ref.prompt, ref.after_call]

    # the sampled tokens (mask 1) and what the template inserted (mask 0): the result, the turn tokens
    inserted = ref.text(ref.inserted)
    assert inserted.startswith("<｜User｜><tool_result>42\n</tool_result>")
    assert inserted.endswith("<｜Assistant｜><think>")
    mask = [1.0] * len(ref.call_turn) + [0.0] * len(ref.inserted) + [1.0] * len(ref.answer_turn)
    assert sample.loss_mask == mask
    assert sample.rollout_logprobs == engine.sampled[0] + [0.0] * len(ref.inserted) + engine.sampled[1]
    assert sample.final_turn_ids == ref.answer_turn
    assert sample.response_text == ref.text(sample.response_ids)

    traj = sample.trajectory
    assert tool.args == [{"code": "print(6*7)"}] and (tool.opened, tool.closed) == (1, 1)
    assert (traj.tool_calls, traj.parse_errors, traj.tool_errors) == (1, 0, 0)
    assert (traj.tito_mismatches, traj.retokenized_turns) == (0, 0)
    call = traj.messages[1]
    assert call["reasoning_content"] == "I should compute it with the tool."
    assert call["tool_calls"][0]["function"] == {"name": "python", "arguments": ARGUMENTS}
    assert traj.messages[2]["content"] == TOOL_OUTPUT
    assert traj.messages[3]["content"] == "The answer is 42."
    assert traj.turns[0].calls[0]["result"] == TOOL_OUTPUT


MALFORMED = {
    "bad_json": (
        '<｜DSML｜invoke name="python">\n'
        '<｜DSML｜parameter name="code" string="false">print(</｜DSML｜parameter>\n</｜DSML｜invoke>',
        "<tool_result>error: the arguments are not valid JSON",
    ),
    "unknown_tool": (
        '<｜DSML｜invoke name="calculator">\n'
        '<｜DSML｜parameter name="code" string="true">6*7</｜DSML｜parameter>\n</｜DSML｜invoke>',
        "<tool_result>error: unknown tool 'calculator'; tools: python",
    ),
}


def malformed_turn(ref: Reference, invoke: str) -> list[int]:
    text = f"I will call it.</think>\n\n<｜DSML｜tool_calls>\n{invoke}\n</｜DSML｜tool_calls>"
    return ref.ids(text) + [ref.eos]


@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_malformed_call_comes_back_as_an_error_result(ref, kind):
    invoke, error = MALFORMED[kind]
    turn = malformed_turn(ref, invoke)
    answer = ref.ids("The call failed.</think>I cannot check it.") + [ref.eos]
    tool = FakePython()
    engine = ScriptedEngine([turn, answer])
    sample = run(make_runner(ref, tool), engine)

    assert len(engine.inputs) == 2
    second = engine.inputs[1]
    assert second[: len(ref.prompt) + len(turn)] == ref.prompt + turn  # the sampled turn kept verbatim
    assert error in ref.text(second[len(ref.prompt) + len(turn) :])
    assert tool.args == []  # a malformed call is never run
    traj = sample.trajectory
    assert traj.parse_errors == 1 and traj.tool_errors == 0
    assert traj.turns[0].calls[0]["malformed"] and traj.turns[0].calls[0]["result"].startswith("error: ")
    assert sample.finish_reason == "stop"
    assert sample.loss_mask[: len(turn)] == [1.0] * len(turn)
    assert sample.loss_mask[-len(answer) :] == [1.0] * len(answer)
    assert sum(sample.loss_mask) == len(turn) + len(answer)
    assert (tool.opened, tool.closed) == (1, 1)


@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_malformed_call_under_terminate_aborts(ref, kind):
    turn = malformed_turn(ref, MALFORMED[kind][0])
    tool = FakePython()
    engine = ScriptedEngine([turn, ref.answer_turn])
    sample = run(make_runner(ref, tool, on_malformed_call=MalformedCall.terminate), engine)
    assert sample.finish_reason == "abort"
    assert len(engine.inputs) == 1 and tool.args == []
    assert sample.response_ids == turn and sample.loss_mask == [1.0] * len(turn)
    assert sample.trajectory.parse_errors == 1
    assert (tool.opened, tool.closed) == (1, 1)


def not_append_only(runner: TrajectoryRunner, monkeypatch) -> None:
    """Every render after the first changes a token of the prompt."""
    encode = runner.format.encode
    renders = []

    def changed(messages):
        ids = list(encode(messages))
        renders.append(1)
        if len(renders) > 1:
            ids[3] = ids[3] + 1
        return ids

    monkeypatch.setattr(runner.format, "encode", changed)


def test_render_that_is_not_append_only_aborts_under_strict(ref, monkeypatch):
    tool = FakePython()
    runner = make_runner(ref, tool, tito_check=TitoCheck.strict)
    not_append_only(runner, monkeypatch)
    engine = ScriptedEngine([ref.call_turn, ref.answer_turn])
    sample = run(runner, engine)
    assert sample.finish_reason == "abort"
    assert len(engine.inputs) == 1
    assert sample.response_ids == ref.call_turn and sample.trajectory.tito_mismatches == 1
    assert (tool.opened, tool.closed) == (1, 1)


def test_render_that_is_not_append_only_is_kept_under_warn(ref, monkeypatch):
    runner = make_runner(ref, FakePython(), tito_check=TitoCheck.warn)
    not_append_only(runner, monkeypatch)
    engine = ScriptedEngine([ref.call_turn, ref.answer_turn])
    sample = run(runner, engine)
    assert sample.finish_reason == "stop"
    assert len(engine.inputs) == 2 and sample.trajectory.tito_mismatches == 1
    full = sample.prompt_ids + sample.response_ids  # the first render and the model's own tokens kept
    assert full == ref.full[: len(full)]
    assert sum(sample.loss_mask) == len(ref.call_turn) + len(ref.answer_turn)
