"""A code task's reward: run the data row's unit tests against the response in a subprocess, with a timeout.

The data rows carry the tests and the function's name as columns of their own (`tests`, `entry_point`,
see code_problems.jsonl); every column reaches the reward as `sample.metadata`. The program is the
response's fenced ```python block; a response without one is taken as the body of `entry_point`
(`def solution(): return <response>`), which is what the tiny model can write: one digit.

The score is the fraction of tests that pass; `compiled` (the program ran at all) is logged beside it. The
subprocess is the sandbox here: for untrusted code on a cluster, run it in a container or a remote service
(examples/reward_server.py) instead.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

from dsv4rl.reward import RewardInput

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


def run_tests(sample: RewardInput, timeout_s: float = 5.0) -> dict:
    """`score`: the share of `metadata["tests"]` that pass; `compiled`: 1.0 when the program ran."""
    tests = list(sample.metadata["tests"])
    source = program(sample, sample.metadata["entry_point"]) + RUNNER.format(tests=tests)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "solution.py"
        path.write_text(source)
        try:
            done = subprocess.run(
                [sys.executable, "-I", str(path)],
                capture_output=True,
                text=True,
                timeout=timeout_s,
                cwd=folder,
            )
        except subprocess.TimeoutExpired:
            return {"score": 0.0, "compiled": 1.0}  # an endless loop: ran, passed nothing
    if done.returncode != 0 or not done.stdout.strip():
        return {"score": 0.0, "compiled": 0.0}
    passed = int(done.stdout.strip().splitlines()[-1].split(":")[1].strip(" }"))
    return {"score": passed / max(len(tests), 1), "compiled": 1.0}
