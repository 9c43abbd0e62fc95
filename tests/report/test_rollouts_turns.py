"""Rollout records of multi-turn samples: each turn's text, the inserted text, the calls and the loss mask as
runs; `dsv4rl rollouts` shows the turns with the inserted (masked) spans marked. Single-turn records keep
exactly their fields."""

from __future__ import annotations

import json
import re
from pathlib import Path

from typer.testing import CliRunner

from dsv4rl.cli import app
from dsv4rl.data.problems import Problem
from dsv4rl.report.rollouts import FIELDS, TRAJECTORY_FIELDS, load_step
from dsv4rl.reward.results import Outcome
from dsv4rl.samples import Sample, Trajectory, TurnRecord
from dsv4rl.train.rollout_records import rollout_records, write_rollouts
from dsv4rl.train.trajectory_records import mask_runs

runner = CliRunner()
CHARS = "?=7.x"  # id i is CHARS[i]: a decoder without a tokenizer


def decode(ids: list[int]) -> str:
    return "".join(CHARS[i] for i in ids)


def tool_sample() -> Sample:
    """ "?" (a call) -> "=7." inserted -> "7": two turns, one call, 3 masked tokens."""
    call = {"id": "call_0_0", "name": "lookup", "arguments": "", "malformed": False, "error": False,
            "timed_out": False, "time_s": 0.01, "result": "7."}  # fmt: skip
    turns = [TurnRecord(0, 1, 4, "length", [call]), TurnRecord(4, 5, 5, "length", [], reward=0.5)]
    messages = [
        {"role": "user", "content": "Q:"},
        {"role": "assistant", "content": "?", "tool_calls": [{"function": {"name": "lookup"}}]},
        {"role": "tool", "tool_call_id": "call_0_0", "content": "7."},
        {"role": "assistant", "content": "7"},
    ]
    trajectory = Trajectory(turns=turns, messages=messages, tool_calls=1)
    mask = [1.0, 0.0, 0.0, 0.0, 1.0]
    logprobs = [-0.1, 0.0, 0.0, 0.0, -0.2]
    return Sample(0, [9], [0, 1, 2, 3, 2], logprobs, "?=7.7", "length", answer="7", reward=1.0, advantage=0.5,
                  loss_mask=mask, trajectory=trajectory)  # fmt: skip


def single_sample() -> Sample:
    return Sample(0, [9], [4], [-0.3], "x", "length", answer="7", reward=0.0, advantage=-0.5)


def records(decoder=decode) -> list[dict]:  # noqa: ANN001
    samples = [tool_sample(), single_sample()]
    problems = [Problem("Q:", "7", "tool-0")] * 2
    outcomes = [{"correct": Outcome(1.0)}, {"correct": Outcome(0.0)}]
    return rollout_records(samples, problems, outcomes, None, samples, 3, decoder)


def test_mask_runs() -> None:
    assert mask_runs([]) == []
    assert mask_runs([1.0, 1.0, 0.0, 0.0, 0.0, 1.0]) == [[0, 2, 1.0], [2, 5, 0.0], [5, 6, 1.0]]


def test_a_multi_turn_record_carries_its_turns_and_mask() -> None:
    multi, single = records()
    assert set(single) == set(FIELDS)  # single turn: no new keys
    assert set(multi) == set(FIELDS) | set(TRAJECTORY_FIELDS)
    first, last = multi["turns"]
    assert (first["text"], first["inserted"], first["finish_reason"]) == ("?", "=7.", "length")
    assert first["calls"][0]["name"] == "lookup" and first["calls"][0]["result"] == "7."
    assert (last["text"], last["inserted"], last["reward"]) == ("7", "", 0.5)
    assert multi["loss_mask"] == [[0, 1, 1.0], [1, 4, 0.0], [4, 5, 1.0]]
    assert multi["tool_calls"] == 1 and multi["finish_reason"] == "length"
    assert multi["answer"] == "7" and multi["response"] == "?=7.7"  # graded: the last turn
    json.dumps(multi)  # every value JSON-safe


def test_without_a_decoder_the_texts_come_from_the_conversation() -> None:
    multi, _ = records(None)
    first, last = multi["turns"]
    assert (first["text"], first["inserted"]) == ("?", "[tool] 7.")
    assert (last["text"], last["inserted"]) == ("7", "")


def test_the_rollouts_command_marks_inserted_spans(tmp_path: Path) -> None:
    samples = [tool_sample(), single_sample()]
    problems = [Problem("Q:", "7", "tool-0")] * 2
    outcomes = [{"correct": Outcome(1.0)}, {"correct": Outcome(0.0)}]
    write_rollouts(tmp_path, 3, samples, problems, outcomes, None, samples, decode)
    _, saved = load_step(tmp_path)
    assert saved[0]["turns"][0]["inserted"] == "=7." and "turns" not in saved[1]
    shown = runner.invoke(app, ["rollouts", str(tmp_path), "--n", "1"], terminal_width=200)
    assert shown.exit_code == 0, shown.output
    out = shown.output
    assert "turn 1 (length)" in out and "turn 2 (length, reward 0.5)" in out
    assert "[inserted, 3 tokens masked: =7.]" in out and "lookup() → 7." in out
    assert "2 turns · 1 calls · 3 masked tokens" in out
    assert "response" in out  # the single-turn sample keeps its plain response row
    listed = json.loads(runner.invoke(app, ["rollouts", str(tmp_path), "--json"]).stdout)
    assert listed["samples"][0]["loss_mask"] == [[0, 1, 1.0], [1, 4, 0.0], [4, 5, 1.0]]


def test_the_rollouts_command_shows_what_a_tool_or_an_environment_raised(tmp_path: Path) -> None:
    sample = tool_sample()
    traceback = (
        'Traceback (most recent call last):\n  File "/srv/s.py", line 12, in lookup\n'
        '    raise RuntimeError("index offline")\nRuntimeError: index offline\n'
    )
    exception = {"type": "RuntimeError", "message": "index offline", "traceback": traceback}
    call = sample.trajectory.turns[0].calls[0]
    call.update(error=True, result="error: RuntimeError: index offline", exception=exception)
    sample.trajectory.turns[1].exception = {"type": "ValueError", "message": "no board", "traceback": ""}
    write_rollouts(tmp_path, 3, [sample], [Problem("Q:", "7", "tool-0")], [{}], None, [sample], decode)
    _, saved = load_step(tmp_path)
    assert saved[0]["turns"][0]["calls"][0]["exception"] == exception
    assert saved[0]["turns"][1]["exception"]["type"] == "ValueError"
    out = runner.invoke(app, ["rollouts", str(tmp_path), "--n", "1"], terminal_width=200).output
    assert "lookup() → error: RuntimeError: index offline" in out and "(the tool raised, 0.01 s)" in out
    assert re.search(r"raised +RuntimeError: index offline", out), out
    assert 'File "/srv/s.py", line 12, in lookup' in out and 'raise RuntimeError("index offline")' in out
    assert re.search(r"raised +ValueError: no board", out), out  # the environment's step
