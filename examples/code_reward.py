"""A code task's reward: run the data row's unit tests against the response in dsv4rl's sandbox.

The data rows carry the tests and the function's name as columns of their own (`tests`, `entry_point`,
see code_problems.jsonl); every column reaches the reward as `sample.metadata`. The program is the
response's fenced ```python block; a response without one is taken as the body of `entry_point`
(`def solution(): return <response>`), which is what the tiny model can write: one digit.

The score is the fraction of tests that pass; `compiled` (the program ran at all) is logged beside it. The
program is the model's code, so it runs where the `python` tool runs the model's code: isolated
(namespaces, or Landlock + seccomp; docs/agents.md), one process, 512 MB, or not at all. The sandbox is
built when this module is imported, at validation, so a node that cannot isolate refuses the recipe
before anything starts. An async function: the calls wait on their subprocesses, on the trainer's event
loop, `reward.async_concurrency` at a time.
"""

from __future__ import annotations

import json
import re

from dsv4rl.reward import RewardInput
from dsv4rl.tools.python_tool import PythonTool

SANDBOX = PythonTool(timeout_s=5.0, memory_mb=512, max_processes=1, max_output_chars=512)
FENCE = re.compile(r"```(?:python)?\n(.*?)```", re.S)
RUNNER = """
import json, sys
passed = 0
for test in {tests!r}:
    try:
        exec(test, globals())
        passed += 1
    except Exception:
        pass
print(json.dumps({{"passed": passed}}))
"""


def program(sample: RewardInput, entry_point: str) -> str:
    """The code to test: the last fenced block, else the answer as the body of `entry_point`."""
    text = sample.answer or ""
    blocks = FENCE.findall(text)
    if blocks:
        return blocks[-1]
    return f"def {entry_point}():\n    return {text.strip() or 'None'}\n"


async def run_tests(sample: RewardInput) -> dict:
    """`score`: the share of `metadata["tests"]` that pass; `compiled`: 1.0 when the program ran."""
    tests = list(sample.metadata["tests"])
    source = program(sample, sample.metadata["entry_point"]) + RUNNER.format(tests=tests)
    state = await SANDBOX.open(None)  # the sandbox keeps no state of the data row
    try:
        result = await SANDBOX.call(state, {"code": source})
    finally:
        await SANDBOX.close(state)
    if result.timed_out:
        return {"score": 0.0, "compiled": 1.0}  # an endless loop: ran, passed nothing
    last = result.text.strip().splitlines()[-1] if result.text.strip() else ""
    if result.error or not last.startswith("{"):
        return {"score": 0.0, "compiled": 0.0}
    return {"score": json.loads(last)["passed"] / max(len(tests), 1), "compiled": 1.0}
