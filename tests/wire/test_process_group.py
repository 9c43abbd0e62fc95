"""The custom weight-update process group across processes (gloo over loopback)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from dsv4rl.wire.process_group import format_init_method, init_custom_process_group
from free_ports import free_port


def run_worker(*args: str) -> subprocess.Popen:
    """Start `python tests/wire/_pg_worker.py args...` (bounded by `_finish`)."""
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).parent / "_pg_worker.py"), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _finish(process, timeout: float = 90) -> str:
    try:
        out, err = process.communicate(timeout=timeout)
    except Exception:
        process.kill()
        out, err = process.communicate(timeout=10)
        raise AssertionError(f"rank did not finish in {timeout} s: {err[-3000:]}") from None
    assert process.returncode == 0, (
        f"{process.args[2:]} rc={process.returncode} out={out!r} err={err[-3000:]}"
    )
    return out


def test_two_processes_one_with_a_default_group() -> None:
    """Rank 0 is a torchrun-like trainer (default gloo group, agent-store env); rank 1 a bare engine."""
    ports = [str(free_port()), str(free_port())]
    trainer = run_worker("0", *ports, str(free_port()))
    engine = run_worker("1", *ports)
    assert _finish(trainer).strip() == "ok 0"
    assert _finish(engine).strip() == "ok 1"


def test_format_init_method_brackets_ipv6() -> None:
    assert format_init_method("127.0.0.1", 29600) == "tcp://127.0.0.1:29600"
    assert format_init_method("node-1", 29600) == "tcp://node-1:29600"
    assert format_init_method("::1", 29600) == "tcp://[::1]:29600"
    assert format_init_method("[fe80::1]", 5) == "tcp://[fe80::1]:5"


def test_bad_arguments_fail_before_any_rendezvous() -> None:
    with pytest.raises(ValueError, match="choose from"):
        init_custom_process_group("mpi", "tcp://127.0.0.1:1", 2, 0, "g")
    with pytest.raises(ValueError, match="tcp://host:port"):
        init_custom_process_group("gloo", "env://", 2, 0, "g")
    with pytest.raises(ValueError, match="outside the group"):
        init_custom_process_group("gloo", "tcp://127.0.0.1:1", 2, 2, "g")
    if not dist.is_nccl_available():
        with pytest.raises(ValueError, match="gloo"):
            init_custom_process_group("nccl", "tcp://127.0.0.1:1", 2, 0, "g")
