"""The trainer asks for engines to be restarted; the supervisor that runs each one answers.

A push that fails half way on engines whose weight post-processing is not repeatable (aiter's in-place MoE
shuffle, `docs/weights.md`) leaves every engine of the group with weights in an unknown state: none may be
pushed to again. The trainer is healthy and holds the weights, so rather than ending the run (exit 76, a
requeue, a checkpoint read), its rank 0 asks for those engines to be restarted, waits for them, and pushes
again. Only the supervisor of an engine's node can restart it, so the request goes through the run's log
directory, which every node shares (as the heartbeats do):

- `restart-<engine>.json` (the trainer's rank 0): the step and the reason;
- `restart-<engine>.answer.json` (that engine's supervisor, once it started the engine again or refused):
  `{"restarted": bool, "why": str}`; the request is removed then.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from dsv4rl.faults.files import read_json, write_json_atomic

__all__ = ["answer_request", "clear", "pending_request", "read_answer", "request_restart"]


def _request(log_dir: Path | str, name: str) -> Path:
    return Path(log_dir) / f"restart-{name}.json"


def _answer(log_dir: Path | str, name: str) -> Path:
    return Path(log_dir) / f"restart-{name}.answer.json"


def request_restart(log_dir: Path | str, name: str, step: int, reason: str) -> None:
    """Ask for engine `name` to be restarted (an earlier answer is removed first)."""
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        _answer(log_dir, name).unlink()
    write_json_atomic(_request(log_dir, name), {"step": step, "reason": reason, "at": time.time()})


def pending_request(log_dir: Path | str, name: str) -> dict | None:
    """The request for engine `name` not yet answered, or None."""
    return read_json(_request(log_dir, name))


def answer_request(log_dir: Path | str, name: str, restarted: bool, why: str = "") -> None:
    write_json_atomic(_answer(log_dir, name), {"restarted": restarted, "why": why})
    with contextlib.suppress(FileNotFoundError):
        _request(log_dir, name).unlink()


def read_answer(log_dir: Path | str, name: str) -> dict | None:
    return read_json(_answer(log_dir, name))


def clear(log_dir: Path | str, name: str) -> None:
    """At a launch: an earlier attempt's request or answer for engine `name` is not this run's."""
    for path in (_request(log_dir, name), _answer(log_dir, name)):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
