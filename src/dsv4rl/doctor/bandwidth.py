"""`dsv4rl doctor --probe`: a short all-reduce and broadcast across this node's devices, judged.

The probe runs the collectives (`collectives`: one process per visible GPU with NCCL, RCCL on ROCm, or two
CPU processes with gloo on loopback); this module reports bus bandwidth the way nccl-tests / rccl-tests do
(all-reduce: algorithm bandwidth x 2(n-1)/n; broadcast: algorithm bandwidth), next to the GPU's peak link
bandwidth. A short torch.distributed loop reaches well under the peak that rccl-tests reach with large
messages, so the verdict only WARNs below `PASS_FRACTION` of it (a link down, PCIe instead of XGMI/NVLink).
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv4rl.doctor.collectives import Collective
from dsv4rl.doctor.facts import GpuModel, NodeFacts, TorchBuild
from dsv4rl.doctor.probe import SystemProbe
from dsv4rl.doctor.verdict import Check, Status

PASS_FRACTION = 0.4
GPU_BYTES, GPU_ITERS = 256 * 2**20, 10
CPU_BYTES, CPU_ITERS, CPU_WORLD = 16 * 2**20, 5, 2


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
