"""`dsv4rl doctor --probe`: a short all-reduce and broadcast across this node's devices.

One process per visible GPU with NCCL (RCCL on ROCm), or two CPU processes with gloo on loopback. Times
a few collectives of one buffer and reports bus bandwidth the way nccl-tests / rccl-tests do (all-reduce:
algorithm bandwidth x 2(n-1)/n; broadcast: algorithm bandwidth), next to the GPU's peak link bandwidth.
A short torch.distributed loop reaches well under the peak that rccl-tests reach with large messages,
so the verdict only WARNs below `PASS_FRACTION` of it (a link down, PCIe instead of XGMI/NVLink).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum
from pathlib import Path

from dsv4rl.doctor.facts import GpuModel, NodeFacts, TorchBuild
from dsv4rl.doctor.probe import SystemProbe
from dsv4rl.doctor.verdict import Check, Status

PASS_FRACTION = 0.4
GPU_BYTES, GPU_ITERS = 256 * 2**20, 10
CPU_BYTES, CPU_ITERS, CPU_WORLD = 16 * 2**20, 5, 2
WARMUP = 2
DEADLINE_S = 120.0  # a hang (a dead link, a wrong interface) must not hang the doctor


class Collective(StrEnum):
    all_reduce = "all_reduce"
    broadcast = "broadcast"


@dataclass(frozen=True)
class LinkReference:
    """Peak per-GPU, one-direction bandwidth to its peers inside the node (the vendor's data sheet)."""

    link: str
    peak_gbps: float
    source: str


_MI355X = LinkReference(
    "Infinity Fabric (XGMI), 7 links", 537.6, "AMD Instinct MI355X data sheet: 153.6 GB/s per link, both ways"
)
_MI300X = LinkReference(
    "Infinity Fabric (XGMI), 7 links", 448.0, "AMD Instinct MI300X data sheet: 896 GB/s aggregate, both ways"
)
_HOPPER = LinkReference("NVLink 4, 18 links", 450.0, "NVIDIA H100/H200 SXM: 900 GB/s NVLink, both ways")
REFERENCES: dict[GpuModel, LinkReference] = {
    GpuModel.MI355X: _MI355X,
    GpuModel.MI350X: _MI355X,
    GpuModel.MI325X: _MI300X,
    GpuModel.MI300X: _MI300X,
    GpuModel.H100: _HOPPER,
    GpuModel.H200: _HOPPER,
    GpuModel.B200: LinkReference("NVLink 5, 18 links", 900.0, "NVIDIA B200: 1.8 TB/s NVLink, both ways"),
}


def bus_bandwidth(collective: Collective, size_bytes: int, seconds: float, world: int) -> float:
    """GB/s on the busiest link, as nccl-tests define it."""
    algbw = size_bytes / seconds / 1e9
    if collective is Collective.all_reduce:
        return algbw * 2 * (world - 1) / world
    return algbw


def bandwidth_verdict(
    collective: Collective, busbw: float, model: GpuModel | None, world: int, backend: str, mib: int
) -> Check:
    """PASS/WARN against the GPU's reference; CPU/gloo and unknown GPUs have none (PASS, said so)."""
    name = f"probe.{collective.value}"
    measured = f"{busbw:.1f} GB/s bus bandwidth ({world} ranks, {backend}, {mib} MiB)"
    reference = REFERENCES.get(model) if model is not None else None
    if reference is None:
        what = "CPU/gloo over loopback" if backend == "gloo" else f"{model.value if model else 'this GPU'}"
        return Check(name, Status.PASS, f"{measured}; no hardware reference for {what}")
    ratio = busbw / reference.peak_gbps
    detail = f"{measured}; {model.value} {reference.link} peak {reference.peak_gbps:.0f} GB/s ({ratio:.0%})"  # type: ignore[union-attr]
    if ratio >= PASS_FRACTION:
        return Check(name, Status.PASS, detail)
    return Check(
        name,
        Status.WARN,
        f"{detail}, below {PASS_FRACTION:.0%} of peak ({reference.source})",
        "run rccl-tests/nccl-tests all_reduce_perf -b 8 -e 8G -f 2 -g <n>; check `rocm-smi --showtopo` / "
        "`nvidia-smi topo -m` for links running over PCIe",
    )


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


def probe_bandwidth(probe: SystemProbe, facts: NodeFacts) -> list[Check]:
    """Run the collectives on this node's devices and judge them; never raises."""
    gpu_build = facts.build in (TorchBuild.rocm, TorchBuild.cuda)
    world = len(facts.torch.devices) if gpu_build else 0
    if facts.build is TorchBuild.missing:
        return [Check("probe.collectives", Status.SKIP, "torch is not installed")]
    if world == 1:
        return [Check("probe.collectives", Status.SKIP, "one visible GPU: no GPU-to-GPU link to measure")]
    if world >= 2:
        backend, size_bytes, iters, model = "nccl", GPU_BYTES, GPU_ITERS, facts.model
    else:
        backend, size_bytes, iters, world, model = "gloo", CPU_BYTES, CPU_ITERS, CPU_WORLD, None
    try:
        seconds = probe.time_collectives(world, backend, size_bytes, iters)
    except Exception as error:  # a failed collective is the finding
        return [
            Check(
                "probe.collectives",
                Status.FAIL,
                f"{world} ranks on {backend} failed: {type(error).__name__}: {str(error).strip()[:400]}",
                "rerun with NCCL_DEBUG=INFO; check the visibility masks and NCCL_SOCKET_IFNAME",
            )
        ]
    mib = size_bytes // 2**20
    return [
        bandwidth_verdict(
            c, bus_bandwidth(c, size_bytes, seconds[c.value], world), model, world, backend, mib
        )
        for c in Collective
    ]
