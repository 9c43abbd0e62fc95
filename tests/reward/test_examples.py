"""The examples a user copies (examples/): every recipe composes and validates here (targets imported,
signatures checked), and the format/length and group rewards score real samples as documented. The code
task, the remote service and the judge run end to end in tests/e2e/test_reward_fns_cpu.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from dsv4rl.checks.validate import validate
from dsv4rl.config.compose import compose, reward_base_dirs
from dsv4rl.reward.combine import combine
from dsv4rl.reward.inputs import RewardInput
from dsv4rl.reward.rewarder import RewardSet

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RECIPES = sorted(p.name for p in EXAMPLES.glob("*.yaml"))


def test_the_examples_are_there() -> None:
    assert RECIPES == [
        "code_tests.yaml",
        "format_length.yaml",
        "group_reward.yaml",
        "judge.yaml",
        "remote.yaml",
    ]
    assert (EXAMPLES / "reward_server.py").is_file()


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_example_recipe_validates(recipe: str) -> None:
    validate(compose(str(EXAMPLES / recipe)), check_paths=True)


def score(recipe: str, answers: list[str | None]):  # noqa: ANN201
    cfg = compose(str(EXAMPLES / recipe))
    rewards = RewardSet.from_config(cfg.reward, reward_base_dirs(cfg))
    samples = [RewardInput(prompt="3+4=", response=a or "", answer=a, ground_truth="7", index=i,
                           response_ids=[1] * len(a or "x")) for i, a in enumerate(answers)]  # fmt: skip
    loop = asyncio.new_event_loop()
    try:
        outcomes = loop.run_until_complete(rewards.score_group(samples)).outcomes
    finally:
        rewards.close()
        loop.close()
    return combine(rewards.specs, outcomes), outcomes


def test_format_and_length_shape_the_dapo_reward() -> None:
    combined, outcomes = score("format_length.yaml", ["7", "Answer: 7", "x", None])
    assert [o["correct"].score for o in outcomes] == [0.0, 1.0, 0.0, 0.0]  # DAPO reads "Answer: 7" only
    assert [o["format"].score for o in outcomes] == [1.0, 0.0, 0.0, None]  # bare integers (the tiny model)
    assert outcomes[1]["length"].extras["tokens"] == 9.0
    assert combined.totals == [pytest.approx(0.2), 1.0, 0.0, 0.0]  # 1.0 x correct + 0.2 x format


def test_the_group_reward_is_agreement_with_the_majority() -> None:
    combined, outcomes = score("group_reward.yaml", ["7", "7", "8", None])
    assert [o["agree"].score for o in outcomes] == [1.0, 1.0, 0.0, None]
    assert outcomes[0]["agree"].extras == {"share": 0.5}
    assert combined.totals == [pytest.approx(1.1), pytest.approx(1.1), 0.0, 0.0]


def test_the_code_task_runs_the_models_program_in_the_sandbox() -> None:
    """examples/code_reward.py scores through the python tool's sandbox: a hostile answer reaches nothing."""
    import importlib.util
    import socket

    spec = importlib.util.spec_from_file_location("code_reward", EXAMPLES / "code_reward.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.SANDBOX.isolation in ("namespaces", "landlock")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    port = server.getsockname()[1]
    hostile = (
        "```python\nimport ctypes\ndef solution():\n"
        "    fd = ctypes.CDLL(None).socket(2, 1, 0)\n"
        f"    return 7 if fd < 0 else __import__('socket').create_connection(('127.0.0.1', {port}))\n```"
    )
    meta = {"tests": ["assert solution() == 7"], "entry_point": "solution"}

    async def scores():
        answers = ["7", "8", "while True: pass", hostile]
        return [
            await module.run_tests(RewardInput(prompt="", response=a, answer=a, metadata=meta))
            for a in answers
        ]

    try:
        right, wrong, loop, contained = asyncio.run(scores())
        with pytest.raises(BlockingIOError):
            server.accept()
    finally:
        server.close()
    assert right == {"score": 1.0, "compiled": 1.0} and wrong == {"score": 0.0, "compiled": 1.0}
    assert loop["score"] == 0.0
    assert contained == {"score": 1.0, "compiled": 1.0}  # it ran, and its socket() was refused
