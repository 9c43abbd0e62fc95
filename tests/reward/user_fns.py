"""Reward functions the tests load by file target (`tests/reward/user_fns.py:name`), as a user writes them."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

from dsv4rl.reward import RewardInput


def ok(sample: RewardInput) -> float:
    return 1.0 if (sample.answer or "").strip()[:1] == sample.ground_truth else 0.0


def sleepy(sample: RewardInput, delay: float = 5.0, every: int = 4) -> dict:
    """Sleeps `delay` seconds on every `every`-th sample (past any short timeout)."""
    if sample.index % every == 0:
        time.sleep(delay)
    return {"score": 1.0, "length": len(sample.response)}


def raises(sample: RewardInput, every: int = 2) -> float:
    if sample.index % every == 1:
        raise ZeroDivisionError("raised on purpose")
    return 0.5


def constant(sample: RewardInput, value: float = 0.0) -> float:
    """The same reward for every response: no group ever has a gradient."""
    return value


def nothing(sample: RewardInput) -> None:
    return None


def ranks(samples: list[RewardInput]) -> list[float]:
    """A group function: each sample's place in its group."""
    return [float(i) for i in range(len(samples))]


def short_group(samples: list[RewardInput]) -> list[float]:
    return [1.0] * (len(samples) - 1)


async def async_ok(sample: RewardInput, bonus: float = 0.0) -> float:
    await asyncio.sleep(0)
    return 1.0 + bonus


async def async_slow(sample: RewardInput) -> float:
    await asyncio.sleep(10)
    return 1.0


def dies(sample: RewardInput) -> float:
    os._exit(3)


def returns_text(sample: RewardInput) -> str:
    return "seven"


def no_sample() -> float:  # wrong signature: takes no sample
    return 1.0


def number_in_brackets(reply: str) -> float | None:
    """A judge's parse function: the number in [[...]]."""
    start, end = reply.find("[["), reply.find("]]")
    return float(reply[start + 2 : end]) if 0 <= start < end else None


def hangs(sample: RewardInput) -> float:
    time.sleep(3600)
    return 1.0


_SLEEPER = "import time; time.sleep(300)"
# Forks, and the child leaves the session, says so (touches argv[2]) and sleeps; the parent exits at once:
# the child is an orphan in a session of its own, as a daemon is.
_DAEMON = """
import os, sys, time
if os.fork():
    os._exit(0)
os.setsid()
open(sys.argv[2], "w").close()
time.sleep(300)
"""


def spawns(sample: RewardInput, marker_dir: str, then: str = "hang") -> float:
    """Starts three processes that outlive the call unless they are killed, each with the name of
    `marker_dir` in its argv: a child, a child in a session of its own, a daemon (forked by a child that
    exits, then setsid); touches `marker_dir`/spawned; then hangs, returns 1.0 (`then="return"`) or kills
    its worker (`then="die"`)."""
    folder = Path(marker_dir)
    python = [sys.executable, "-I", "-S", "-c"]
    subprocess.Popen([*python, _SLEEPER, folder.name])
    subprocess.Popen([*python, _SLEEPER, folder.name], start_new_session=True)
    daemon = folder / f"daemon-{os.getpid()}-{sample.index}"
    subprocess.run([*python, _DAEMON, folder.name, str(daemon)], check=True)
    while not daemon.exists():
        time.sleep(0.01)
    (folder / "spawned").touch()
    if then == "die":
        os._exit(3)
    if then == "hang":
        time.sleep(3600)
    return 1.0


def orphan(sample: RewardInput, marker: str) -> float:
    """Leaves an orphan (`marker` in its argv) that exits a moment later, as `sh -c "cmd &"` does: someone
    must reap it."""
    code = "import os, time\nif os.fork():\n    os._exit(0)\ntime.sleep(0.2)"
    subprocess.run([sys.executable, "-I", "-S", "-c", code, marker], check=True)
    return 1.0
