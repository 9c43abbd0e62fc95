"""The doctor's pieces: tool-output parsers, NCCL's syntax, no_proxy matching, mounts, the bandwidth
verdict, a real gloo probe, and the live probe's cheapness."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4rl.doctor.bandwidth import bandwidth_verdict, bus_bandwidth, probe_bandwidth
from dsv4rl.doctor.checks_network import _bypassed, mount_of
from dsv4rl.doctor.collectives import Collective, run_ranks
from dsv4rl.doctor.facts import (
    GpuModel,
    gather_facts,
    identify_model,
    parse_lspci_amd,
    parse_nvidia_smi,
    parse_rocminfo,
    version_tuple,
)
from dsv4rl.doctor.probe import RecordedProbe, SystemProbe
from dsv4rl.doctor.report import run_checks
from dsv4rl.doctor.verdict import Status

STATES = Path(__file__).parent / "states"


def recorded(name: str) -> dict:
    return json.loads((STATES / f"{name}.json").read_text())


def test_rocminfo_keeps_gpu_agents_with_arch_name_and_vram() -> None:
    text = recorded("mi355x_reference")["commands"]["rocminfo"]["stdout"]
    gpus = parse_rocminfo(text)
    assert len(gpus) == 8  # the two CPU agents are left out
    assert {(g.name, g.arch) for g in gpus} == {("AMD Instinct MI355X", "gfx950")}
    assert gpus[0].memory_bytes == 288 * 2**30
    assert parse_rocminfo("") == []


def test_rocminfo_without_marketing_name_falls_back_to_the_arch_family() -> None:
    text = "*******\nAgent 1\n*******\n  Name:  gfx942\n  Device Type:  GPU\n"
    (gpu,) = parse_rocminfo(text)
    assert (gpu.name, gpu.arch, gpu.memory_bytes) == ("MI300X/MI325X", "gfx942", None)


def test_nvidia_smi_csv() -> None:
    gpus = parse_nvidia_smi("NVIDIA H100 80GB HBM3, 81559\nNVIDIA H100 80GB HBM3, 81559\n\n")
    assert [(g.name, g.memory_bytes) for g in gpus] == [("NVIDIA H100 80GB HBM3", 81559 * 2**20)] * 2


def test_lspci_ids_and_model_identification() -> None:
    text = (
        "05:00.0 Processing accelerators [1200]: Advanced Micro Devices, Inc. [AMD/ATI] Device [1002:75a3]\n"
        "c1:00.0 Non-Essential Instrumentation [1300]: Advanced Micro Devices [AMD] Device [1022:14dc]\n"
    )
    assert parse_lspci_amd(text) == ["75a3"]
    assert identify_model([], ["75a3"]) is GpuModel.MI355X
    assert identify_model([], ["74a1"]) is GpuModel.MI300X
    assert identify_model(["AMD Instinct MI325X"], ["74a1"]) is GpuModel.MI325X  # the name wins
    assert identify_model(["NVIDIA H200"], None) is GpuModel.H200
    assert identify_model(["Radeon Pro W7900"], None) is GpuModel.other
    assert identify_model([], None) is None


def test_version_tuple() -> None:
    assert version_tuple("7.13.0-12") == (7, 13, 0)
    assert version_tuple("6.4") < (7, 13) <= version_tuple("7.13.0")[:2]  # type: ignore[operator]
    assert version_tuple("") is None and version_tuple("unknown") is None


@pytest.mark.parametrize(
    ("host", "entries", "bypassed"),
    [
        ("10.10.0.1", ["10.10.0.0/16"], True),
        ("10.11.0.1", ["10.10.0.0/16"], False),
        ("node3.cluster", [".cluster"], True),
        ("node3.cluster", ["cluster"], True),
        ("node3.cluster", ["*.cluster"], True),
        ("node3", ["node"], False),
        ("anything", ["*"], True),
        ("127.0.0.1", ["localhost"], False),  # httpx matches hosts literally: 127.0.0.1 must be listed
    ],
)
def test_no_proxy_matching(host: str, entries: list[str], bypassed: bool) -> None:
    assert _bypassed(host, entries) is bypassed


def test_mount_of_takes_the_longest_mount_point() -> None:
    mounts = "overlay / overlay rw 0 0\nfs:/x /data lustre rw 0 0\n/dev/sdb /data/local ext4 rw 0 0\n"
    assert mount_of("/data/runs/a", mounts) == ("/data", "lustre")
    assert mount_of("/data/local/runs", mounts) == ("/data/local", "ext4")
    assert mount_of("/datax/runs", mounts) == ("/", "overlay")


def test_bus_bandwidth_follows_nccl_tests() -> None:
    assert bus_bandwidth(Collective.all_reduce, 10**9, 1.0, 8) == pytest.approx(1.75)
    assert bus_bandwidth(Collective.broadcast, 10**9, 0.5, 8) == pytest.approx(2.0)


def test_bandwidth_verdict_against_the_gpu_reference() -> None:
    good = bandwidth_verdict(Collective.all_reduce, 300.0, GpuModel.MI300X, 8, "nccl", 256)
    assert good.status is Status.PASS and "448 GB/s" in good.detail
    slow = bandwidth_verdict(Collective.all_reduce, 40.0, GpuModel.MI355X, 8, "nccl", 256)
    assert slow.status is Status.WARN and "all_reduce_perf" in slow.remedy
    cpu = bandwidth_verdict(Collective.broadcast, 3.0, None, 2, "gloo", 16)
    assert cpu.status is Status.PASS and "no hardware reference" in cpu.detail


def test_failed_collectives_fail_the_probe() -> None:
    state = recorded("h100")
    state["collective_seconds"] = {"error": "NCCL error: unhandled system error"}
    report = run_checks(RecordedProbe(state), None, bandwidth=True)
    check = report.by_name()["probe.collectives"]
    assert check.status is Status.FAIL and "unhandled system error" in check.detail
    assert "NCCL_DEBUG=INFO" in check.remedy


def test_one_gpu_has_no_link_to_measure() -> None:
    state = recorded("h100")
    state["torch"]["devices"] = state["torch"]["devices"][:1]
    probe = RecordedProbe(state)
    checks = probe_bandwidth(probe, gather_facts(probe))
    assert [(c.name, c.status) for c in checks] == [("probe.collectives", Status.SKIP)]


def test_gloo_probe_runs_two_cpu_ranks_on_loopback() -> None:
    """The real --probe path on CPU: two spawned ranks, all-reduce and broadcast over gloo."""
    seconds = run_ranks(2, "gloo", 2**20, 2)
    assert set(seconds) == {"all_reduce", "broadcast"}
    assert all(0 < s < 30 for s in seconds.values())


def test_live_probe_reads_a_cpu_torch_without_importing_it() -> None:
    """A CPU build's version comes from torch/version.py: `import torch` costs seconds the doctor saves."""
    code = (
        "import sys, json; from dsv4rl.doctor.probe import SystemProbe; info = SystemProbe().torch_info(); "
        "print(json.dumps([info.version, info.cuda, info.hip, 'torch' in sys.modules]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    version, cuda, hip, imported = json.loads(out.stdout)
    import importlib.metadata

    assert version == importlib.metadata.version("torch")
    if cuda is None and hip is None:
        assert imported is False


def test_live_probe_answers_for_a_missing_tool_and_a_missing_path(tmp_path: Path) -> None:
    probe = SystemProbe()
    assert probe.run(["dsv4rl-no-such-tool-xyz"]) is None
    assert probe.read_file(str(tmp_path / "absent")) is None
    assert probe.listdir(str(tmp_path / "absent")) is None
    usage = probe.disk_usage(str(tmp_path / "not" / "yet" / "created"))
    assert usage is not None and usage.path == str(tmp_path.resolve()) and usage.free > 0
    assert probe.resolve("127.0.0.1") == ["127.0.0.1"]
