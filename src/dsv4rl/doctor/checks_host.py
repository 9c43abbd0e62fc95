"""Host settings and RDMA: the kernel and container settings GPU collectives depend on.

Sources: AMD's MI300X system-optimization and MI300X/MI355X workload-tuning guides (NUMA auto-balancing
off, `iommu=pt` on the kernel command line), the RCCL/NCCL docs (RDMA needs locked memory without limit,
`/dev/shm` for intra-node transports, `NCCL_IB_HCA` syntax), and Docker's defaults (64 MiB /dev/shm).
"""

from __future__ import annotations

import re

from dsv4rl.doctor.context import Context
from dsv4rl.doctor.facts import GpuVendor
from dsv4rl.doctor.probe import UNLIMITED, Limit
from dsv4rl.doctor.verdict import Check, Status

GIB = 2**30
NUMA_BALANCING = "/proc/sys/kernel/numa_balancing"
CMDLINE = "/proc/cmdline"
THP = "/sys/kernel/mm/transparent_hugepage/enabled"
SHM = "/dev/shm"
IB_CLASS = "/sys/class/infiniband"
IB_DEV = "/dev/infiniband"
MIN_NOFILE = 65536  # thousands of sockets and files: trainer ranks, engines, HTTP clients, checkpoints
MIN_SHM_GPU = 8 * GIB  # AMD's container examples pass --shm-size 16G or --ipc=host; 8 GiB is a floor
MIN_SHM_CPU = 1 * GIB


def check_numa_balancing(ctx: Context) -> Check:
    value = (ctx.probe.read_file(NUMA_BALANCING) or "").strip()
    if not value:
        return Check("host.numa_balancing", Status.SKIP, f"{NUMA_BALANCING} is not readable")
    if value == "0":
        return Check("host.numa_balancing", Status.PASS, "NUMA auto-balancing is off")
    if not ctx.gpu_node:
        return Check(
            "host.numa_balancing", Status.SKIP, f"numa_balancing={value}; it matters on GPU nodes only"
        )
    return Check(
        "host.numa_balancing",
        Status.WARN,
        f"numa_balancing={value}: the kernel migrates pages under the GPUs' pinned buffers, which costs "
        "throughput and has been linked to hangs (AMD's MI300X tuning guide: turn it off)",
        "sudo sysctl -w kernel.numa_balancing=0 (persist in /etc/sysctl.d/)",
    )


def check_iommu(ctx: Context) -> Check:
    if ctx.facts.vendor is not GpuVendor.amd:
        return Check("host.iommu", Status.SKIP, "no AMD GPU (iommu=pt is AMD's recommendation)")
    cmdline = ctx.probe.read_file(CMDLINE)
    if cmdline is None:
        return Check("host.iommu", Status.SKIP, f"{CMDLINE} is not readable")
    if re.search(r"(^|\s)iommu=pt(\s|$)", cmdline):
        return Check("host.iommu", Status.PASS, "kernel command line has iommu=pt")
    return Check(
        "host.iommu",
        Status.WARN,
        "kernel command line lacks iommu=pt: with the IOMMU translating, GPU peer-to-peer and RDMA "
        "traffic slows down or stalls (AMD's MI300X/MI355X system guides ask for passthrough)",
        "add iommu=pt to GRUB_CMDLINE_LINUX, update-grub, reboot",
    )


def _limit_text(value: int, unit_bytes: bool = False) -> str:
    if value == UNLIMITED:
        return "unlimited"
    return f"{value / 2**20:g} MiB" if unit_bytes else str(value)


def check_memlock(ctx: Context) -> Check:
    soft, hard = ctx.probe.rlimit(Limit.memlock)
    if soft == UNLIMITED:
        return Check("host.memlock", Status.PASS, "locked memory: unlimited")
    rdma = bool(ctx.probe.listdir(IB_CLASS))  # RLIMIT_MEMLOCK is in bytes (`ulimit -l` shows KiB)
    detail = f"locked memory limited to {_limit_text(soft, True)} (hard {_limit_text(hard, True)})"
    if not ctx.gpu_node:
        return Check("host.memlock", Status.SKIP, f"{detail}; it matters on GPU/RDMA nodes only")
    status = Status.FAIL if rdma or ctx.multi_node else Status.WARN
    return Check(
        "host.memlock",
        status,
        f"{detail}: RDMA registers (locks) the communication buffers and fails past the limit",
        "ulimit -l unlimited (/etc/security/limits.conf; containers: --ulimit memlock=-1:-1)",
    )


def check_nofile(ctx: Context) -> Check:
    soft, hard = ctx.probe.rlimit(Limit.nofile)
    if soft == UNLIMITED or soft >= MIN_NOFILE:
        return Check("host.nofile", Status.PASS, f"open files: {_limit_text(soft)}")
    return Check(
        "host.nofile",
        Status.WARN,
        f"open files limited to {soft} (hard {_limit_text(hard)}): engines, trainer ranks and their "
        "connections can run out ('Too many open files')",
        f"ulimit -n {max(MIN_NOFILE, 1048576)} (containers: --ulimit nofile=1048576:1048576)",
    )


def check_hugepages(ctx: Context) -> Check:
    text = ctx.probe.read_file(THP)
    if text is None:
        return Check("host.hugepages", Status.SKIP, f"{THP} is not readable")
    match = re.search(r"\[(\w+)\]", text)
    mode = match.group(1) if match else text.strip()
    if mode in ("always", "madvise"):
        return Check("host.hugepages", Status.PASS, f"transparent huge pages: {mode}")
    return Check(
        "host.hugepages",
        Status.WARN if ctx.gpu_node else Status.SKIP,
        f"transparent huge pages: {mode}: large pinned host buffers (CPU optimizer offload, weight sync "
        "staging) pay for 4 KiB pages",
        f"echo madvise | sudo tee {THP}",
    )


def check_shm(ctx: Context) -> Check:
    usage = ctx.probe.disk_usage(SHM)
    if usage is None or usage.path != SHM:
        return Check("host.shm", Status.SKIP, f"{SHM} is not mounted")
    need = MIN_SHM_GPU if ctx.gpu_node else MIN_SHM_CPU
    detail = f"{SHM}: {usage.total / GIB:.1f} GiB ({usage.free / GIB:.1f} GiB free)"
    if usage.total >= need:
        return Check("host.shm", Status.PASS, detail)
    status = Status.FAIL if usage.total < MIN_SHM_CPU and ctx.gpu_node else Status.WARN
    return Check(
        "host.shm",
        status,
        f"{detail}, below {need / GIB:.0f} GiB: NCCL/RCCL's intra-node transport and torch's worker "
        "processes allocate there ('Error while creating shared-memory segment')",
        "start the container with --ipc=host or --shm-size=64g",
    )


def _port_states(ctx: Context) -> dict[str, dict[str, str]]:
    """{device: {port: state}} from /sys/class/infiniband/<dev>/ports/<n>/state ('4: ACTIVE')."""
    states: dict[str, dict[str, str]] = {}
    for device in ctx.probe.listdir(IB_CLASS) or []:
        ports = ctx.probe.listdir(f"{IB_CLASS}/{device}/ports") or []
        states[device] = {}
        for port in ports:
            text = ctx.probe.read_file(f"{IB_CLASS}/{device}/ports/{port}/state") or "?"
            states[device][port] = text.split(":", 1)[-1].strip()
    return states


def _named_hcas(value: str) -> tuple[list[str], bool]:
    """Device names in NCCL_IB_HCA ('=mlx5_0:1,mlx5_1' / '^mlx5_2'); True when it is an exclusion list."""
    value = value.strip()
    exclude = value.startswith("^")
    names = [part.split(":")[0] for part in value.lstrip("^=").split(",") if part.strip()]
    return names, exclude


def check_rdma(ctx: Context) -> Check:
    states = _port_states(ctx)
    need = ctx.multi_node
    if not states:
        if need:
            return Check(
                "rdma.devices",
                Status.FAIL,
                f"no RDMA device in {IB_CLASS}, but the recipe spans several nodes: collectives would fall "
                "back to TCP sockets",
                "install the NIC driver (mlx5_ib, ionic) and start containers with --device=/dev/infiniband "
                "--network=host",
            )
        return Check("rdma.devices", Status.SKIP, "no RDMA devices (needed only for multi-node runs)")
    active = sorted(d for d, ports in states.items() if any(s == "ACTIVE" for s in ports.values()))
    down = sorted(f"{d}/{p}={s}" for d, ports in states.items() for p, s in ports.items() if s != "ACTIVE")
    detail = f"{len(active)}/{len(states)} RDMA device(s) ACTIVE ({', '.join(active) or 'none'})"
    if down:
        detail += f"; not active: {', '.join(down)}"
    hca = ctx.process_env().get("NCCL_IB_HCA")
    if hca:
        names, exclude = _named_hcas(hca)
        if not exclude:
            missing = [n for n in names if not any(d == n or d.startswith(n) for d in active)]
            if missing:
                return Check(
                    "rdma.devices",
                    Status.FAIL,
                    f"{detail}; NCCL_IB_HCA={hca} names {', '.join(missing)}, not an active device here",
                    f"set NCCL_IB_HCA to active devices (+comm.env.NCCL_IB_HCA={','.join(active)})",
                )
    if not ctx.probe.exists(IB_DEV) or not ctx.probe.listdir(IB_DEV):
        return Check(
            "rdma.devices",
            Status.FAIL if need else Status.WARN,
            f"{detail}, but {IB_DEV} is missing: user space (this container) cannot open the devices",
            "start the container with --device=/dev/infiniband (and --cap-add=IPC_LOCK)",
        )
    if not active:
        return Check(
            "rdma.devices",
            Status.FAIL if need else Status.WARN,
            detail,
            "check cabling and the subnet manager / switch (`ibstat`, `ibv_devinfo`)",
        )
    if down and need:
        return Check(
            "rdma.devices",
            Status.WARN,
            detail,
            "bring the ports up or leave them out with NCCL_IB_HCA (+comm.env.NCCL_IB_HCA=<active devices>)",
        )
    return Check("rdma.devices", Status.PASS, detail)


CHECKS = (
    check_numa_balancing,
    check_iommu,
    check_memlock,
    check_nofile,
    check_hugepages,
    check_shm,
    check_rdma,
)
