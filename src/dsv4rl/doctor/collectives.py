"""The collectives `dsv4rl doctor --probe` times: one process per rank, seconds per all-reduce and broadcast.

One process per visible GPU with NCCL (RCCL on ROCm), or CPU processes with gloo on loopback. Lives below
the probe layer (`SystemProbe.time_collectives` runs it); the verdicts on the seconds are `bandwidth`'s.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from datetime import timedelta
from enum import StrEnum
from pathlib import Path

WARMUP = 2
DEADLINE_S = 120.0  # a hang (a dead link, a wrong interface) must not hang the doctor


class Collective(StrEnum):
    all_reduce = "all_reduce"
    broadcast = "broadcast"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker(rank: int, world: int, port: int, backend: str, size_bytes: int, iters: int, out: str) -> None:
    """One rank: time each collective, keep the slowest rank's time (what a step waits for)."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    gpu = backend == "nccl"
    if gpu:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if gpu else torch.device("cpu")
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=60))

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize()

    buffer = torch.ones(size_bytes // 4, dtype=torch.float32, device=device)
    seconds: dict[str, float] = {}
    for collective in Collective:

        def op(c: Collective = collective) -> None:
            if c is Collective.all_reduce:
                dist.all_reduce(buffer)
            else:
                dist.broadcast(buffer, src=0)

        for _ in range(WARMUP):
            op()
        sync()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            op()
        sync()
        elapsed = torch.tensor([(time.perf_counter() - start) / iters], device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        seconds[collective.value] = float(elapsed.item())
    if rank == 0:
        Path(out).write_text(json.dumps(seconds))
    dist.destroy_process_group()


def run_ranks(world: int, backend: str, size_bytes: int, iters: int) -> dict[str, float]:
    """Seconds per collective (slowest rank), by Collective value; raises when a rank fails or hangs."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="dsv4rl-doctor-") as tmp:
        out = str(Path(tmp) / "seconds.json")
        # spawn, never fork: a parent whose torch already ran OpenMP threads (or touched CUDA) forks
        # children that hang in their first parallel op (seen inside a long pytest session)
        args = (world, _free_port(), backend, size_bytes, iters, out)
        context = mp.start_processes(_worker, args=args, nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + DEADLINE_S
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the collectives did not finish in {DEADLINE_S:.0f} s")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
        return json.loads(Path(out).read_text())
