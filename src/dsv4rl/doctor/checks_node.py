"""Software and GPU checks: Python, torch and its build, NCCL/RCCL, ROCm, megatron-core, the SGLang
interpreter, and the GPUs (model, architecture, count, memory, PCI ids)."""

from __future__ import annotations

from dsv4rl.config.choices import RolloutEngineKind, TrainBackend
from dsv4rl.doctor.context import NO_RECIPE, Context
from dsv4rl.doctor.facts import AMD_PCI_IDS, GpuVendor, TorchBuild, version_tuple
from dsv4rl.doctor.verdict import Check, Status
from dsv4rl.launcher.engine_python import (
    INSTALL_FIX,
    engine_python,
    interpreter_problems,
    node_runs_sglang,
)

MIN_PYTHON = (3, 11)  # pyproject's requires-python
GIB = 2**30
TORCH_FIX = {
    GpuVendor.amd: "install a ROCm build of torch: `make install GPU=1 TORCH_INDEX=https://download.pytorch.org/"
    "whl/rocm<X.Y>` (or use the ROCm SGLang image's python)",
    GpuVendor.nvidia: "install a CUDA build of torch: `make install GPU=1`",
}


def check_python(ctx: Context) -> Check:
    version = ctx.probe.python_version()
    ok = (version_tuple(version) or (0,)) >= MIN_PYTHON
    need = ".".join(map(str, MIN_PYTHON))
    if ok:
        return Check("software.python", Status.PASS, f"Python {version}")
    return Check(
        "software.python", Status.FAIL, f"Python {version}; dsv4rl needs >= {need}", f"use Python >= {need}"
    )


def check_torch(ctx: Context) -> Check:
    info, build, vendor = ctx.facts.torch, ctx.facts.build, ctx.facts.vendor
    if build is TorchBuild.missing:
        return Check("software.torch", Status.FAIL, info.error or "torch is not installed", "`make install`")
    toolkit = {TorchBuild.rocm: f"ROCm/HIP {info.hip}", TorchBuild.cuda: f"CUDA {info.cuda}"}.get(
        build, "CPU"
    )
    detail = f"torch {info.version} ({toolkit} build)"
    wanted = {GpuVendor.amd: TorchBuild.rocm, GpuVendor.nvidia: TorchBuild.cuda}.get(vendor)
    if wanted is not None and build is not wanted:
        return Check(
            "software.torch",
            Status.FAIL,
            f"{detail} on a node with {vendor.value.upper()} GPUs: it cannot use them",
            TORCH_FIX[vendor],
        )
    if info.error:
        return Check(
            "software.torch", Status.WARN, f"{detail}; {info.error}", "check the GPU driver and runtime"
        )
    if vendor is GpuVendor.none and build is not TorchBuild.cpu:
        detail += " (no GPU found: torch falls back to CPU)"
    return Check("software.torch", Status.PASS, detail)


def check_nccl(ctx: Context) -> Check:
    info, build = ctx.facts.torch, ctx.facts.build
    library = "RCCL" if build is TorchBuild.rocm else "NCCL"
    if build in (TorchBuild.cpu, TorchBuild.missing):
        return Check("software.nccl", Status.SKIP, "no GPU build of torch: collectives run on gloo")
    if info.nccl is None:
        return Check(
            "software.nccl",
            Status.WARN,
            f"torch.cuda.nccl.version() gave no {library} version ({info.error or 'not built with it?'})",
            f"use a torch build with {library} (the official wheels have it)",
        )
    return Check("software.nccl", Status.PASS, f"{library} {info.nccl} (torch.cuda.nccl.version())")


def check_rocm(ctx: Context) -> Check:
    facts = ctx.facts
    version, hip = facts.rocm_version, facts.torch.hip
    if facts.vendor is not GpuVendor.amd:
        if version is None:
            return Check("software.rocm", Status.SKIP, "no AMD GPU, no /opt/rocm")
        return Check("software.rocm", Status.PASS, f"ROCm {version} at /opt/rocm (no AMD GPU found)")
    if version is None:
        return Check(
            "software.rocm",
            Status.WARN,
            "/opt/rocm/.info/version is missing: the ROCm version (and which RCCL settings apply) is unknown",
            "install ROCm at /opt/rocm or link it there (the ROCm containers have it)",
        )
    detail = f"ROCm {version}; torch built for HIP {hip or '-'}"
    system, built = version_tuple(version), version_tuple(hip)
    if system and built and system[0] != built[0]:
        return Check(
            "software.rocm",
            Status.WARN,
            f"{detail}: different major releases (torch brings its own HIP runtime, the driver and tools "
            "are the system's)",
            f"install torch built for ROCm {system[0]}.x, or a ROCm {built[0]}.x userspace",
        )
    return Check("software.rocm", Status.PASS, detail)


def check_megatron(ctx: Context) -> Check:
    version = ctx.probe.package_version("megatron-core")
    needed = ctx.cfg is not None and ctx.cfg.parallel.train.backend == TrainBackend.megatron
    if version is not None:
        return Check("software.megatron", Status.PASS, f"megatron-core {version}")
    if needed:
        return Check(
            "software.megatron",
            Status.FAIL,
            "megatron-core is not installed, but the recipe trains with parallel.train.backend=megatron",
            "pip install -e '.[megatron]' (megatron-core==0.16.1)",
        )
    return Check(
        "software.megatron", Status.SKIP, "megatron-core not installed (needed only by the megatron backend)"
    )


def check_sglang(ctx: Context) -> Check:
    cfg = ctx.cfg
    if cfg is None:
        return Check("software.sglang", Status.SKIP, NO_RECIPE)
    if cfg.parallel.rollout.engine != RolloutEngineKind.sglang:
        return Check("software.sglang", Status.SKIP, "the recipe uses the reference engine, not SGLang")
    if not node_runs_sglang(cfg):
        return Check(
            "software.sglang",
            Status.SKIP,
            f"node {cfg.cluster.node_rank} runs no SGLang engine in this layout",
        )
    trainer_torch = ctx.facts.torch.version or "(none)"
    info = ctx.probe.engine_interpreter(engine_python(cfg))
    problems = interpreter_problems(info, trainer_torch)
    if problems:
        torch_mismatch = any("runs torch" in p or "has no torch" in p for p in problems)
        remedy = (
            "run one torch release in both environments (`make install GPU=1` gives the trainer SGLang's)"
            if torch_mismatch and len(problems) == 1
            else INSTALL_FIX
        )
        return Check("software.sglang", Status.FAIL, "; ".join(problems), remedy)
    return Check(
        "software.sglang",
        Status.PASS,
        f"sglang {info.sglang} with torch {info.torch} (trainer: {trainer_torch}) at {info.executable}",
    )


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / GIB:.0f} GiB"


def check_gpus(ctx: Context) -> Check:
    facts, cfg = ctx.facts, ctx.cfg
    needed = cfg.cluster.gpus_per_node if cfg is not None else 0
    tools = "; ".join(facts.notes) or "no GPU reported"
    if not facts.has_gpu:
        on_bus = [i for i in facts.amd_pci_ids or [] if i in AMD_PCI_IDS]
        if on_bus:
            return Check(
                "gpu.devices",
                Status.FAIL,
                f"lspci shows {len(on_bus)} AMD Instinct GPU(s) but the ROCm runtime reports none ({tools})",
                "load amdgpu (`modprobe amdgpu`), install ROCm, and start containers with "
                "--device=/dev/kfd --device=/dev/dri",
            )
        if needed:
            return Check(
                "gpu.devices",
                Status.FAIL,
                f"no GPU on this machine ({tools}), but the recipe needs {needed} per node",
                "run on a GPU node, or pick a CPU recipe (e.g. recipe=tiny_arith)",
            )
        status = Status.PASS if cfg is not None else Status.WARN
        return Check(
            "gpu.devices",
            status,
            f"no GPU on this machine ({tools}): only CPU recipes (tiny_arith) run here",
            "" if cfg is not None else "run the doctor on a GPU node for a cluster run",
        )
    gpu = facts.gpus[0]
    arch = f" ({facts.arch})" if facts.arch else ""
    detail = f"{len(facts.gpus)} x {gpu.name}{arch}, {_gib(gpu.memory_bytes)} each ({facts.gpu_source})"
    seen = len(facts.torch.devices)
    gpu_torch = facts.build in (TorchBuild.rocm, TorchBuild.cuda) and facts.torch.error is None
    if gpu_torch:
        detail += f"; torch sees {seen}"
    if needed > len(facts.gpus):
        return Check(
            "gpu.devices",
            Status.FAIL,
            f"{detail}; the recipe needs {needed} per node",
            f"set cluster.gpus_per_node={len(facts.gpus)} and a layout that fits, or use a larger node",
        )
    if gpu_torch and needed > seen:
        return Check(
            "gpu.devices",
            Status.FAIL,
            f"{detail}; the recipe needs {needed}: visibility masks hide GPUs from torch",
            "unset HIP_VISIBLE_DEVICES, ROCR_VISIBLE_DEVICES, CUDA_VISIBLE_DEVICES (dsv4rl places processes)",
        )
    return Check("gpu.devices", Status.PASS, detail)


def check_pci(ctx: Context) -> Check:
    facts = ctx.facts
    if facts.vendor is not GpuVendor.amd:
        return Check("gpu.pci", Status.SKIP, "no AMD GPU")
    if facts.amd_pci_ids is None:
        return Check("gpu.pci", Status.SKIP, "lspci is not installed (pciutils)")
    known = [i for i in facts.amd_pci_ids if i in AMD_PCI_IDS]
    kinds = sorted({f"1002:{i} {AMD_PCI_IDS[i].value}" for i in known})
    detail = f"{len(known)} Instinct GPU(s) on the PCI bus ({', '.join(kinds) or 'no known Instinct id'})"
    if facts.gpus and len(known) != len(facts.gpus):  # none at all: gpu.devices says so
        return Check(
            "gpu.pci",
            Status.WARN,
            f"{detail}, but {facts.gpu_source} reports {len(facts.gpus)}: a GPU is not initialised "
            "(or the container sees only some)",
            "check `dmesg | grep amdgpu` and the container's --device list",
        )
    return Check("gpu.pci", Status.PASS, detail)


CHECKS = (
    check_python,
    check_torch,
    check_nccl,
    check_rocm,
    check_megatron,
    check_sglang,
    check_gpus,
    check_pci,
)
