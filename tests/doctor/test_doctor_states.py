"""`dsv4rl doctor` on recorded nodes: the verdicts a ROCm engineer would give for each machine state."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from dsv4rl.config.compose import compose
from dsv4rl.config.schema import Config
from dsv4rl.doctor.probe import RecordedProbe
from dsv4rl.doctor.report import DoctorReport, run_checks
from dsv4rl.doctor.verdict import Status

STATES = Path(__file__).parent / "states"
SGLANG_PYTHON = "/opt/venv-sglang/bin/python"


def state(name: str) -> dict:
    return json.loads((STATES / f"{name}.json").read_text())


def doctor(state_or_name: dict | str, cfg: Config | None = None, bandwidth: bool = False) -> DoctorReport:
    data = state(state_or_name) if isinstance(state_or_name, str) else state_or_name
    return run_checks(RecordedProbe(data), cfg, bandwidth=bandwidth)


def problems(report: DoctorReport) -> dict[str, Status]:
    return {c.name: c.status for c in report.checks if c.status in (Status.WARN, Status.FAIL)}


def dapo_on_mi355x(*extra: str) -> Config:
    """The 4-node reference recipe as node 2 (an SGLang node) of the recorded MI355X cluster."""
    return compose(
        "dapo_math",
        [
            "cluster.master_addr=10.10.0.1",
            "cluster.node_addrs=[mi355x-node0,mi355x-node1,mi355x-node2,mi355x-node3]",
            "cluster.node_rank=2",
            f"engine.python={SGLANG_PYTHON}",
            "run.dir=/lustre/runs/dapo",
            *extra,
        ],
    )


def test_every_state_file_loads_and_says_what_it_is() -> None:
    names = sorted(p.stem for p in STATES.glob("*.json"))
    assert names == ["cpu_only", "h100", "mi300x_planted", "mi355x_reference"]
    for name in names:
        assert state(name)["description"]


# ------------------------------------------------------------------------------------------ MI355X
def test_mi355x_reference_node_has_no_problem_without_a_recipe() -> None:
    report = doctor("mi355x_reference", bandwidth=True)
    assert problems(report) == {}
    assert report.exit_code == 0
    checks = report.by_name()
    assert "8 x AMD Instinct MI355X (gfx950), 288 GiB each" in checks["gpu.devices"].detail
    assert "1002:75a3 MI355X" in checks["gpu.pci"].detail
    assert checks["software.nccl"].detail.startswith("RCCL 2.27.7")
    assert "ROCm 7.1.1" in checks["software.rocm"].detail
    assert checks["probe.all_reduce"].status is Status.PASS and "MI355X" in checks["probe.all_reduce"].detail
    assert report.summary()["gpus"] == "8 x AMD Instinct MI355X"


def test_mi355x_reference_node_passes_every_check_of_the_reference_recipe() -> None:
    report = doctor("mi355x_reference", dapo_on_mi355x())
    assert {c.name: c.status for c in report.checks if c.status is not Status.PASS} == {}
    checks = report.by_name()
    assert "comm=rccl_mi355x sets 24 variables, 24 exported here" in checks["env.comm_preset"].detail
    assert "sglang 0.5.23" in checks["software.sglang"].detail
    assert "lustre" in checks["storage.shared_fs"].detail
    ports = checks["network.ports"].detail  # node 2 (the first rollout node) runs engine 0, no master
    assert "30000 (engine 0" in ports and "30001" not in ports and "29500" not in ports


def test_mi355x_recipe_without_a_shared_run_dir_fails() -> None:
    report = doctor("mi355x_reference", dapo_on_mi355x("run.dir=/scratch/runs/dapo"))
    check = report.by_name()["storage.shared_fs"]
    assert check.status is Status.FAIL and "/scratch (ext4)" in check.detail
    assert "every node mounts" in check.remedy


def test_a_shell_value_different_from_the_preset_warns_with_both_values() -> None:
    node = state("mi355x_reference")
    node["env"]["NCCL_MIN_NCHANNELS"] = "64"
    check = doctor(node, dapo_on_mi355x()).by_name()["env.comm_preset"]
    assert check.status is Status.WARN
    assert "NCCL_MIN_NCHANNELS=64 (recipe: 16)" in check.detail


def test_a_preset_missing_from_the_shell_passes_because_the_launcher_sets_it() -> None:
    node = state("mi355x_reference")
    del node["env"]["HSA_NO_SCRATCH_RECLAIM"]
    check = doctor(node, dapo_on_mi355x()).by_name()["env.comm_preset"]
    assert check.status is Status.PASS and "HSA_NO_SCRATCH_RECLAIM" in check.detail


# ------------------------------------------------------------------------------------------ MI300X
def test_mi300x_flags_exactly_the_planted_problems() -> None:
    report = doctor("mi300x_planted")
    assert problems(report) == {
        "host.numa_balancing": Status.WARN,
        "env.stale_rccl": Status.WARN,
        "env.visible_devices": Status.FAIL,
        "env.hsa_xnack": Status.WARN,
    }
    assert report.exit_code == 1
    checks = report.by_name()
    assert "kernel.numa_balancing=0" in checks["host.numa_balancing"].remedy
    assert (
        "ROCm 7.13" in checks["env.stale_rccl"].detail
        and "unset RCCL_MSCCL_ENABLE" in checks["env.stale_rccl"].remedy
    )
    visible = checks["env.visible_devices"]
    assert (
        "HIP_VISIBLE_DEVICES=0,1,2,3" in visible.detail and "CUDA_VISIBLE_DEVICES=4,5,6,7" in visible.detail
    )
    assert "unset HIP_VISIBLE_DEVICES and CUDA_VISIBLE_DEVICES" in visible.remedy
    assert (
        "discrete MI300X" in checks["env.hsa_xnack"].detail
        and "unset HSA_XNACK" in checks["env.hsa_xnack"].remedy
    )
    assert "(gfx942)" in checks["gpu.devices"].detail


def test_mi300x_fixed_node_has_no_problem() -> None:
    node = state("mi300x_planted")
    for name in ("RCCL_MSCCL_ENABLE", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "HSA_XNACK"):
        del node["env"][name]
    node["files"]["/proc/sys/kernel/numa_balancing"] = "0\n"
    node["torch"]["devices"] = node["torch"]["devices"] * 2  # the mask hid half of them
    assert problems(doctor(node)) == {}


def test_mi300x_msccl_on_an_older_rocm_is_not_stale() -> None:
    node = state("mi300x_planted")
    node["files"]["/opt/rocm/.info/version"] = "6.4.1-120\n"
    check = doctor(node).by_name()["env.stale_rccl"]
    assert check.status is Status.PASS


def test_mi300x_masks_hide_gpus_the_recipe_needs() -> None:
    cfg = dapo_on_mi355x("cluster.node_rank=0")  # a trainer node: 8 GPUs
    check = doctor("mi300x_planted", cfg).by_name()["gpu.devices"]
    assert check.status is Status.FAIL and "torch sees 4" in check.detail
    assert "HIP_VISIBLE_DEVICES" in check.remedy


def test_rocr_mask_with_hip_indices_beyond_it_fails() -> None:
    node = state("mi355x_reference")
    node["env"].update(ROCR_VISIBLE_DEVICES="4,5", HIP_VISIBLE_DEVICES="4,5")
    check = doctor(node).by_name()["env.visible_devices"]
    assert check.status is Status.FAIL and "4, 5 do not exist" in check.detail


# ------------------------------------------------------------------------------------------ H100
def test_h100_node_is_recognised_and_has_no_problem() -> None:
    cfg = compose(
        "dapo_math",
        [
            "comm=nccl_h100",
            "cluster.master_addr=10.20.0.1",
            "cluster.node_addrs=[h0,h1,h2,h3]",
            f"engine.python={SGLANG_PYTHON}",
            "run.dir=/home/user/runs/dapo",
        ],
    )
    report = doctor("h100", cfg, bandwidth=True)
    assert problems(report) == {}
    checks = report.by_name()
    assert checks["gpu.devices"].detail.startswith("8 x NVIDIA H100 80GB HBM3, 80 GiB each (nvidia-smi)")
    assert checks["software.torch"].detail == "torch 2.14.1+cu128 (CUDA 12.8 build)"
    assert checks["software.nccl"].detail.startswith("NCCL 2.27.5")
    for amd_only in ("host.iommu", "gpu.pci", "env.stale_rccl", "env.hsa_xnack", "software.rocm"):
        assert checks[amd_only].status is Status.SKIP, amd_only
    assert "H100" in checks["probe.all_reduce"].detail and "NVLink" in checks["probe.all_reduce"].detail


def test_h100_with_a_rocm_torch_fails() -> None:
    node = state("h100")
    node["torch"] = {"version": "2.14.1+rocm7.1", "hip": "7.1.25424", "nccl": "2.27.7", "devices": []}
    check = doctor(node).by_name()["software.torch"]
    assert check.status is Status.FAIL and "CUDA build" in check.remedy


# ------------------------------------------------------------------------------------------ CPU only
def test_cpu_only_says_plainly_there_is_no_gpu() -> None:
    report = doctor("cpu_only")
    check = report.by_name()["gpu.devices"]
    assert check.status is Status.WARN
    assert check.detail.startswith("no GPU on this machine")
    assert "rocminfo is not installed" in check.detail and "nvidia-smi is not installed" in check.detail
    assert report.summary()["gpus"] == "none (no GPU on this machine)"
    assert report.exit_code == 0
    # GPU-host settings do not apply; a CPU build of torch has no NCCL
    for name in ("host.numa_balancing", "host.memlock", "software.nccl", "host.iommu"):
        assert report.by_name()[name].status is Status.SKIP, name


def test_cpu_only_passes_a_cpu_recipe_and_fails_a_gpu_recipe() -> None:
    tiny = doctor("cpu_only", compose("tiny_arith", ["run.dir=/home/user/runs/tiny"]))
    assert tiny.by_name()["gpu.devices"].status is Status.PASS
    assert [c.name for c in tiny.checks if c.status is Status.FAIL] == []
    dapo = doctor("cpu_only", compose("dapo_math", ["cluster.node_addrs=[a,b,c,d]"]))
    gpu = dapo.by_name()["gpu.devices"]
    assert gpu.status is Status.FAIL and "needs 8 per node" in gpu.detail
    assert dapo.by_name()["rdma.devices"].status is Status.FAIL
    assert dapo.exit_code == 1


def test_cpu_only_probe_reports_that_there_is_no_reference() -> None:
    check = doctor("cpu_only", bandwidth=True).by_name()["probe.all_reduce"]
    assert check.status is Status.PASS and "no hardware reference for CPU/gloo" in check.detail
    assert "2 ranks, gloo" in check.detail


# ------------------------------------------------------------------------------------------ variants
ALL_HOSTS = "127.0.0.1,10.10.0.1,mi355x-node0,mi355x-node1,mi355x-node2,mi355x-node3"


@pytest.mark.parametrize(
    ("no_proxy", "status"),
    [(None, Status.FAIL), ("localhost,10.10.0.0/16,.cluster", Status.FAIL), (ALL_HOSTS, Status.PASS),
     ("*", Status.PASS)],
)  # fmt: skip
def test_proxy_must_not_catch_the_engines(no_proxy: str | None, status: Status) -> None:
    node = state("mi355x_reference")
    node["env"]["https_proxy"] = node["env"]["http_proxy"] = "http://proxy.corp:3128"
    if no_proxy is not None:
        node["env"]["no_proxy"] = no_proxy
    check = doctor(node, dapo_on_mi355x()).by_name()["network.proxy"]
    assert check.status is status
    if status is Status.FAIL:
        assert "mi355x-node2" in check.detail and check.remedy.startswith("export no_proxy=")


def test_socket_ifname_naming_a_missing_interface_fails() -> None:
    node = state("mi355x_reference")
    node["env"]["NCCL_SOCKET_IFNAME"] = "eth0"
    check = doctor(node).by_name()["env.socket_ifname"]
    assert check.status is Status.FAIL and "NCCL_SOCKET_IFNAME=eth0" in check.detail
    assert "ens50f0" in check.detail  # the interfaces that do exist


@pytest.mark.parametrize(
    ("spec", "ok"), [("=ens50f0", True), ("ens", True), ("^docker,lo", True), ("=ens5", False)]
)
def test_socket_ifname_follows_nccl_syntax(spec: str, ok: bool) -> None:
    node = state("mi355x_reference")
    node["env"]["NCCL_SOCKET_IFNAME"] = spec
    status = doctor(node).by_name()["env.socket_ifname"].status
    assert status is (Status.PASS if ok else Status.FAIL)


def test_busy_port_fails_naming_the_config_key() -> None:
    node = state("mi355x_reference")
    node["busy_ports"].append(30000)
    check = doctor(node, dapo_on_mi355x()).by_name()["network.ports"]
    assert check.status is Status.FAIL
    assert "30000" in check.detail and "engine.port" in check.remedy


def test_unresolvable_master_address_fails() -> None:
    cfg = dapo_on_mi355x("cluster.master_addr=node-zero.invalid")
    check = doctor("mi355x_reference", cfg).by_name()["network.master_addr"]
    assert check.status is Status.FAIL and "node-zero.invalid does not resolve" in check.detail


def test_shell_sglang_variable_that_contradicts_the_recipe_fails() -> None:
    """SGLANG_DSV4_FP4_EXPERTS=0 in the shell: engines inherit it; with quant=fp8_mxfp4 it breaks loading."""
    node = state("mi355x_reference")
    node["env"]["SGLANG_DSV4_FP4_EXPERTS"] = "0"
    check = doctor(node, dapo_on_mi355x("quant=fp8_mxfp4")).by_name()["env.sglang"]
    assert check.status is Status.FAIL
    assert "SGLANG_DSV4_FP4_EXPERTS=0" in check.detail and "from this shell" in check.detail
    assert "unset the shell's SGLANG_DSV4_FP4_EXPERTS" in check.remedy
    without_recipe = doctor(node).by_name()["env.sglang"]
    assert without_recipe.status is Status.WARN and "converts nothing" in without_recipe.detail


def test_sglang_interpreter_with_another_torch_fails() -> None:
    node = state("mi355x_reference")
    node["engine_interpreters"][SGLANG_PYTHON]["torch"] = "2.13.0+rocm6.4"
    check = doctor(node, dapo_on_mi355x()).by_name()["software.sglang"]
    assert check.status is Status.FAIL and "2.13.0+rocm6.4" in check.detail
    assert "torch" in check.remedy


def test_missing_sglang_interpreter_fails_with_the_install_fix() -> None:
    check = doctor("mi355x_reference", dapo_on_mi355x("engine.python=/nowhere/python")).by_name()[
        "software.sglang"
    ]
    assert check.status is Status.FAIL and "make install-sglang" in check.remedy


def _drop_rocm_runtime(s: dict) -> None:
    s["commands"].pop("rocminfo")
    s["torch"]["devices"] = []  # on the PCI bus, but neither rocminfo nor torch sees a GPU


PLANTED = {
    "memlock": (lambda s: s["rlimits"].update(memlock=[65536, 65536]), "host.memlock", Status.FAIL),
    "no_iommu_pt": (lambda s: s["files"].update({"/proc/cmdline": "ro quiet"}), "host.iommu", Status.WARN),
    "docker_shm": (
        lambda s: s["disk_usage"].update({"/dev/shm": {"total": 64 * 2**20, "free": 64 * 2**20}}),
        "host.shm",
        Status.FAIL,
    ),
    "hca_down": (  # NCCL_IB_HCA names the port that is down
        lambda s: s["files"].update({"/sys/class/infiniband/ionic_3/ports/1/state": "1: DOWN"}),
        "rdma.devices",
        Status.FAIL,
    ),
    "no_dev_infiniband": (lambda s: s["dirs"].pop("/dev/infiniband"), "rdma.devices", Status.FAIL),
    "no_rocm_runtime": (_drop_rocm_runtime, "gpu.devices", Status.FAIL),
    "no_rocm_version": (lambda s: s["files"].pop("/opt/rocm/.info/version"), "software.rocm", Status.WARN),
    "no_megatron": (lambda s: s["packages"].pop("megatron-core"), "software.megatron", Status.FAIL),
    "bad_paths": (
        lambda s: s["recipe_path_problems"].append("model.path '/x' does not exist"),
        "recipe.paths",
        Status.FAIL,
    ),
    "disk_full": (
        lambda s: s["disk_usage"].update({"/lustre": {"total": 2**50, "free": 2**29}}),
        "storage.run_dir",
        Status.FAIL,
    ),
}


@pytest.mark.parametrize(("edit", "name", "status"), PLANTED.values(), ids=PLANTED.keys())
def test_planted_host_problem_is_caught(edit, name: str, status: Status) -> None:
    node = copy.deepcopy(state("mi355x_reference"))
    edit(node)
    report = doctor(node, dapo_on_mi355x())
    check = report.by_name()[name]
    assert check.status is status, check
    assert check.remedy
    assert set(problems(report)) == {name}


def test_the_nvidia_recipe_brings_its_nccl_preset() -> None:
    """`dsv4rl doctor recipe=dapo_math_h200` judges the shell against the recipe's NCCL preset."""
    cfg = compose("dapo_math_h200", [f"engine.python={SGLANG_PYTHON}"])
    check = doctor("h100", cfg).by_name()["env.comm_preset"]
    assert check.status is Status.PASS and check.detail.startswith("comm=nccl_h100 sets 6 variables")
