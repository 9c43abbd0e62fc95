"""What the benchmarks share: free ports, run metadata, engine subprocesses that die with the bench, memcpy.

The bench scripts run as `python bench/<name>.py`, so this module is imported as `_common`.
"""

from __future__ import annotations

import argparse
import atexit
import datetime as dt
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
# One-step-off-policy rollouts as the benches run them (async needs TIS or MIS).
ASYNC_OVERRIDES = ("algo.async_rollout=true", "algo.tis.enabled=true")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def fmt_bytes(n: int) -> str:
    return f"{n / (1 << 30):g} GiB" if n >= 1 << 30 else f"{n / MIB:g} MiB" if n >= MIB else f"{n >> 10} KiB"


def git_commit() -> dict[str, Any]:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": None, "git_dirty": None}
    return {"git_commit": commit or None, "git_dirty": bool(dirty) if commit else None}


def run_meta(bench: str, mode: str, sizes: dict[str, Any]) -> dict[str, Any]:
    """Where and when a result was measured, so JSON from different commits can be compared."""
    return {
        "bench": bench,
        "mode": mode,
        "timestamp": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        **git_commit(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "backend": "gloo",
        "sizes": sizes,
    }


def train_tiny_arith(steps: int, overrides: Sequence[str], run_dir: Path) -> tuple[float, list[dict]]:
    """`dsv4rl train recipe=tiny_arith` as a user runs it, on free ports: (seconds from command to exit,
    the lines of its metrics.jsonl)."""
    argv = [sys.executable, "-m", "dsv4rl.cli", "train", "recipe=tiny_arith", f"run.dir={run_dir}",
            "run.progress=false", f"train.steps={steps}", f"engine.port={free_port()}",
            f"cluster.master_port={free_port()}", f"cluster.weight_sync_port={free_port()}",
            *overrides]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(
            f"dsv4rl train failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}"
        )
    return wall, [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _die_with_parent() -> None:
    """preexec_fn of each child (Linux): SIGKILL it when the bench process dies, even by SIGKILL."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def raise_on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks that stop the engines


def install_signal_handlers() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, raise_on_signal)


class Engines:
    """Child processes (engines, peers); stopped on close(), at exit, and on SIGTERM/SIGINT/SIGHUP."""

    def __init__(self, log_dir: Path, sync_timeout_s: float) -> None:
        self.log_dir = log_dir
        self.env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "DSV4RL_WEIGHT_SYNC_TIMEOUT_S": str(sync_timeout_s),
        }
        self.procs: dict[str, tuple[subprocess.Popen, str, Path]] = {}
        atexit.register(self.close)

    def start(self, name: str, argv: list[str], port: int, **popen: Any) -> subprocess.Popen:
        """Start a child logging to <log_dir>/<name>.log; `popen` may redirect stdout (not stderr)."""
        log = self.log_dir / f"{name}.log"
        with open(log, "wb") as out:
            stdout = popen.pop("stdout", out)
            proc = subprocess.Popen(
                argv,
                stdout=stdout,
                stderr=subprocess.STDOUT if stdout is out else out,
                env=self.env,
                cwd=ROOT,
                preexec_fn=_die_with_parent,
                **popen,
            )
        self.procs[name] = (proc, f"http://127.0.0.1:{port}", log)
        return proc

    def wait_ready(self, timeout_s: float, names: list[str] | None = None) -> dict[str, str]:
        import httpx

        deadline = time.monotonic() + timeout_s
        pending = {n: p for n, p in self.procs.items() if names is None or n in names}
        while pending:
            for name, (proc, url, log) in list(pending.items()):
                if proc.poll() is not None:
                    raise RuntimeError(f"engine {name} exited ({proc.returncode}):\n{self.tail(log)}")
                try:
                    if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                        del pending[name]
                except httpx.HTTPError:
                    pass
            if pending and time.monotonic() > deadline:
                raise RuntimeError(
                    f"engines {sorted(pending)} not healthy after {timeout_s:g} s:\n"
                    + "\n".join(self.tail(log) for _, _, log in pending.values())
                )
            if pending:
                time.sleep(0.2)
        return {name: url for name, (_, url, _) in self.procs.items() if names is None or name in names}

    @staticmethod
    def tail(log: Path, lines: int = 30) -> str:
        try:
            return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return f"(no log at {log})"

    def close(self) -> None:
        procs, self.procs = list(self.procs.values()), {}
        for proc, _, _ in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc, _, _ in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def measure_memcpy(tensors: list[torch.Tensor], repeats: int) -> dict[str, Any]:
    """`copy_` of `tensors` into preallocated ones (after one first-touch copy); the best of `repeats`."""
    dst = [torch.empty_like(t) for t in tensors]
    for d, s in zip(dst, tensors, strict=True):  # first touch: page faults are not bandwidth
        d.copy_(s)
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for d, s in zip(dst, tensors, strict=True):
            d.copy_(s)
        runs.append(time.perf_counter() - start)
    size = nbytes(tensors)
    best = min(runs)
    return {
        "bytes": size,
        "tensors": len(tensors),
        "seconds": best,
        "median_seconds": statistics.median(runs),
        "gb_per_s": size / best / 1e9,
        "runs_seconds": runs,
        "torch_threads": torch.get_num_threads(),
    }


def bench_main(
    doc: str,
    default_out: Path,
    quick_help: str,
    run: Callable[[argparse.Namespace], dict[str, Any]],
    report: Callable[[dict[str, Any]], None],
    argv: list[str] | None = None,
    extra_args: Sequence[tuple[tuple[str, ...], dict[str, Any]]] = (),
) -> int:
    """The command line every bench shares: `[--quick] [--out FILE]` (plus the bench's `extra_args`,
    argparse's (flags, options) pairs), a printed report, JSON results."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=default_out, help=f"JSON results (default {default_out})")
    parser.add_argument("--quick", action="store_true", help=quick_help)
    for flags, options in extra_args:
        parser.add_argument(*flags, **options)
    args = parser.parse_args(argv)
    install_signal_handlers()
    result = run(args)
    report(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out} ({result['meta']['wall_seconds']:.1f} s)")
    return 0
