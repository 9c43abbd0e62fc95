"""What each accelerator of `cluster.device` offers: memory, peak dense BF16 FLOP/s, links.

Numbers from the vendors' public data sheets, in the units they use (decimal GB, dense TFLOP/s without
structured sparsity, GB/s):

- AMD Instinct MI355X data sheet: 288 GB HBM3E; 2.5 PFLOP/s dense FP16/BF16 (256 CUs x 2.4 GHz x 4096
  BF16 FLOP per clock per CU = 2516.6 TFLOP/s; CDNA 4 doubled the per-CU matrix rate of CDNA 3); 7 Infinity
  Fabric links of 153.6 GB/s both ways, so 537.6 GB/s one way to the node's other GPUs.
- AMD Instinct MI300X data sheet: 192 GB HBM3; 1307.4 TFLOP/s dense BF16; 896 GB/s aggregate Infinity
  Fabric both ways (448 one way).
- AMD Instinct MI325X data sheet: 256 GB HBM3E; the MI300X's compute (1307.4 TFLOP/s dense BF16) and links.
- NVIDIA H100 SXM data sheet: 80 GB HBM3; BF16 Tensor Core 1979 TFLOP/s with sparsity, 989.4 dense;
  NVLink 900 GB/s both ways (450 one way).
- NVIDIA H200 SXM data sheet: 141 GB HBM3E; the H100's compute and NVLink.

Between nodes every platform here is assumed to give each GPU one 400 Gb/s NIC (50 GB/s): DGX H100/H200
(8 ConnectX-7 at 400 Gb/s), the MI300X/MI325X OAM platforms and the MI355X's (AMD Pensando Pollara 400).
`cluster.network_gb_per_s` overrides it with the cluster's own.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv4rl.config.choices import DeviceKind
from dsv4rl.config.schema import Config

GB = 1e9  # bytes; the vendors' GB
NIC_400G_GB_PER_S = 50.0


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    memory_gb: float  # HBM per GPU
    bf16_tflops: float  # peak dense BF16 matrix throughput
    link_gb_per_s: float  # one way, to the node's other GPUs (XGMI / NVLink)
    nic_gb_per_s: float  # one way, between nodes, per GPU


DEVICES: dict[DeviceKind, DeviceSpec] = {
    DeviceKind.mi355x: DeviceSpec("AMD Instinct MI355X", 288.0, 2516.6, 537.6, NIC_400G_GB_PER_S),
    DeviceKind.mi300x: DeviceSpec("AMD Instinct MI300X", 192.0, 1307.4, 448.0, NIC_400G_GB_PER_S),
    DeviceKind.mi325x: DeviceSpec("AMD Instinct MI325X", 256.0, 1307.4, 448.0, NIC_400G_GB_PER_S),
    DeviceKind.h100: DeviceSpec("NVIDIA H100 SXM", 80.0, 989.4, 450.0, NIC_400G_GB_PER_S),
    DeviceKind.h200: DeviceSpec("NVIDIA H200 SXM", 141.0, 989.4, 450.0, NIC_400G_GB_PER_S),
}


def device_spec(cfg: Config) -> DeviceSpec | None:
    """The recipe's device, or None on CPU (nothing to estimate against)."""
    return DEVICES.get(cfg.cluster.device)


def network_gb_per_s(cfg: Config, spec: DeviceSpec) -> float:
    """Bandwidth between nodes per GPU: the cluster's when the recipe states it, else the platform NIC's."""
    given = cfg.cluster.network_gb_per_s
    return spec.nic_gb_per_s if given is None else given
