"""What kind of node this is: GPUs (vendor, model, architecture, count, memory), torch's build, ROCm.

Gathered once through the probe and shared by every check. The parsers are pure functions of the tools'
text output (`rocminfo`, `nvidia-smi --query-gpu`, `lspci -nn -d 1002:`), so they are tested on recorded
output. Identification facts: gfx950 is the MI350X/MI355X (CDNA 4), gfx942 the MI300X/MI325X (CDNA 3)
(ROCm's GPU architecture table); PCI device ids from the PCI ID repository (vendor 1002 = AMD/ATI).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum

from dsv4rl.doctor.probe import SystemProbe, TorchInfo


class GpuVendor(StrEnum):
    amd = "amd"
    nvidia = "nvidia"
    none = "none"


class GpuModel(StrEnum):
    MI355X = "MI355X"
    MI350X = "MI350X"
    MI325X = "MI325X"
    MI300X = "MI300X"
    MI300A = "MI300A"  # an APU: the one Instinct where HSA_XNACK=1 is normal
    H100 = "H100"
    H200 = "H200"
    B200 = "B200"
    other = "other"


class TorchBuild(StrEnum):
    rocm = "rocm"
    cuda = "cuda"
    cpu = "cpu"
    missing = "missing"


ARCH_NAMES = {"gfx950": "MI350X/MI355X", "gfx942": "MI300X/MI325X"}
AMD_PCI_IDS = {
    "75a3": GpuModel.MI355X,
    "75a0": GpuModel.MI350X,
    "74a5": GpuModel.MI325X,
    "74a1": GpuModel.MI300X,
    "74a0": GpuModel.MI300A,
}
DISCRETE_AMD = (GpuModel.MI355X, GpuModel.MI350X, GpuModel.MI325X, GpuModel.MI300X)
ROCM_VERSION_FILE = "/opt/rocm/.info/version"
ROCMINFO = ["rocminfo"]
NVIDIA_SMI = ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"]
LSPCI_AMD = ["lspci", "-nn", "-d", "1002:"]


@dataclass(frozen=True)
class Gpu:
    name: str  # marketing or product name
    arch: str | None = None  # gfx950, gfx942 (AMD)
    memory_bytes: int | None = None


@dataclass
class NodeFacts:
    """The node as the checks see it. `gpus`: the node's GPUs (all of them, not only the visible ones)."""

    hostname: str
    env: dict[str, str]
    torch: TorchInfo
    rocm_version: str | None
    vendor: GpuVendor
    model: GpuModel | None
    gpus: list[Gpu]
    gpu_source: str  # "rocminfo", "nvidia-smi", "torch" or "" (none found)
    amd_pci_ids: list[str] | None  # None: lspci not installed
    notes: list[str] = field(default_factory=list)  # tools that were missing or failed

    @property
    def has_gpu(self) -> bool:
        return bool(self.gpus)

    @property
    def build(self) -> TorchBuild:
        return torch_build(self.torch)

    @property
    def arch(self) -> str | None:
        archs = sorted({g.arch for g in self.gpus if g.arch})
        return ",".join(archs) if archs else None


def torch_build(info: TorchInfo) -> TorchBuild:
    if info.version is None:
        return TorchBuild.missing
    if info.hip:
        return TorchBuild.rocm
    if info.cuda:
        return TorchBuild.cuda
    return TorchBuild.cpu


def version_tuple(text: str | None) -> tuple[int, ...] | None:
    """'7.13.0-1234' -> (7, 13, 0); None when it does not start with a number."""
    if not text:
        return None
    match = re.match(r"\s*(\d+(?:\.\d+)*)", text)
    return tuple(int(p) for p in match.group(1).split(".")) if match else None


def parse_rocminfo(text: str) -> list[Gpu]:
    """GPU agents of `rocminfo`: name (gfx arch), marketing name, VRAM (first coarse-grained global pool)."""
    gpus: list[Gpu] = []
    for block in re.split(r"\n\*+\s*\nAgent \d+\s*\n\*+\s*\n", "\n" + text)[1:]:
        fields: dict[str, str] = {}
        memory_kb = None
        coarse = False
        for line in block.splitlines():
            key, _, value = line.strip().partition(":")
            key, value = key.strip(), value.strip()
            if key and key not in fields:
                fields[key] = value
            if key == "Segment":
                coarse = "GLOBAL" in value and "COARSE GRAINED" in value
            elif key == "Size" and coarse and memory_kb is None:
                size = re.match(r"(\d+)", value)
                memory_kb = int(size.group(1)) if size else None
        if fields.get("Device Type") != "GPU":
            continue
        arch = fields.get("Name") or None
        name = fields.get("Marketing Name") or ARCH_NAMES.get(arch or "", arch or "AMD GPU")
        gpus.append(Gpu(name, arch, None if memory_kb is None else memory_kb * 1024))
    return gpus


def parse_nvidia_smi(text: str) -> list[Gpu]:
    """`nvidia-smi --query-gpu=name,memory.total --format=csv,noheader,nounits` (memory in MiB)."""
    gpus = []
    for line in text.splitlines():
        if not line.strip():
            continue
        name, _, memory = line.rpartition(",")
        try:
            gpus.append(Gpu(name.strip(), None, int(float(memory.strip())) * 2**20))
        except ValueError:
            gpus.append(Gpu(line.strip()))
    return gpus


def parse_lspci_amd(text: str) -> list[str]:
    """Device ids of AMD (1002) functions that are Instinct accelerators or display controllers."""
    ids = []
    for line in text.splitlines():
        match = re.search(r"\[1002:([0-9a-fA-F]{4})\]", line)
        if match and ("accelerator" in line.lower() or "display" in line.lower() or "[03" in line):
            ids.append(match.group(1).lower())
    return ids


def identify_model(names: list[str], pci_ids: list[str] | None) -> GpuModel | None:
    """The GPU model from marketing/product names, then from AMD PCI ids; None when there is no GPU."""
    for model in GpuModel:
        if model is not GpuModel.other and any(model.value in n.upper() for n in names):
            return model
    for pci_id in pci_ids or []:
        if pci_id in AMD_PCI_IDS:
            return AMD_PCI_IDS[pci_id]
    return GpuModel.other if names else None


def gather_facts(probe: SystemProbe) -> NodeFacts:
    """Ask the probe once for what every check needs."""
    torch = probe.torch_info()
    rocm_file = probe.read_file(ROCM_VERSION_FILE)
    rocm_version = rocm_file.strip() if rocm_file else None
    notes: list[str] = []
    gpus: list[Gpu] = []
    vendor, source = GpuVendor.none, ""

    for tool, cmd, parse, tool_vendor in (
        ("rocminfo", ROCMINFO, parse_rocminfo, GpuVendor.amd),
        ("nvidia-smi", NVIDIA_SMI, parse_nvidia_smi, GpuVendor.nvidia),
    ):
        result = probe.run(cmd)
        if result is None:
            notes.append(f"{tool} is not installed")
        elif result.returncode != 0:
            why = (result.stderr.strip() or result.stdout.strip())[:160]
            notes.append(f"{tool} failed (exit {result.returncode}: {why})")
        else:
            gpus = parse(result.stdout)
            if gpus:
                vendor, source = tool_vendor, tool
                break
    if not gpus and torch.devices:  # neither tool answered, but torch sees devices
        gpus = [Gpu(d.name, None, d.memory_bytes) for d in torch.devices]
        vendor = GpuVendor.amd if torch.hip else GpuVendor.nvidia
        source = "torch"

    lspci = probe.run(LSPCI_AMD)
    pci_ids = parse_lspci_amd(lspci.stdout) if lspci is not None and lspci.returncode == 0 else None
    if vendor is GpuVendor.none and pci_ids and any(i in AMD_PCI_IDS for i in pci_ids):
        vendor = GpuVendor.amd  # the GPUs are on the bus but no driver/runtime reports them
    model = identify_model([g.name for g in gpus], pci_ids if vendor is GpuVendor.amd else None)
    return NodeFacts(
        hostname=probe.hostname(),
        env=probe.env(),
        torch=torch,
        rocm_version=rocm_version,
        vendor=vendor,
        model=model,
        gpus=gpus,
        gpu_source=source,
        amd_pci_ids=pci_ids,
        notes=notes,
    )
