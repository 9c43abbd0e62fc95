"""The launch scripts: valid bash, and the commands they run compose and validate with their recipes.

The sbatch script runs here under fake `scontrol` and `srun` (srun starts the task command once per node
with SLURM_NODEID set) and a fake `dsv4rl` that records its arguments; each node's arguments are then
composed and validated, and the node plans are checked against the fake hostnames.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4rl.checks.validate import validate
from dsv4rl.cli import _split_recipe
from dsv4rl.config.compose import compose
from dsv4rl.launcher.plan import build_local_plan, engine_urls, remote_engine_health

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "launch" / "slurm" / "dapo_math_4node.sbatch"
LOCAL = ROOT / "launch" / "local_cpu.sh"
GPU_CHECK = ROOT / "launch" / "gpu_check.sh"
HOSTS = ["gpu-a01", "gpu-a02", "gpu-a03", "gpu-a04"]

FAKE_DSV4RL = f"""#!{sys.executable}
import json, os, sys
rank = os.environ.get("SLURM_NODEID", "local")
with open(os.path.join(os.environ["FAKE_OUT"], f"node-{{rank}}.json"), "w") as f:
    json.dump(sys.argv[1:], f)
"""
FAKE_SCONTROL = """#!/bin/bash
[[ $1 == show && $2 == hostnames && $3 == "gpu-a[01-04]" ]] || { echo "unexpected: $*" >&2; exit 1; }
printf '%s\\n' gpu-a01 gpu-a02 gpu-a03 gpu-a04
"""
FAKE_SRUN = """#!/bin/bash
printf '%s\\n' "$@" > "$FAKE_OUT/srun-args"
while [[ $1 == -* ]]; do shift; done
for node in 0 1 2 3; do SLURM_NODEID=$node "$@" || exit $?; done
"""


def _fake_bin(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("dsv4rl", FAKE_DSV4RL), ("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


@pytest.mark.parametrize("script", [SBATCH, LOCAL, GPU_CHECK], ids=lambda p: p.name)
def test_scripts_are_valid_bash(script: Path) -> None:
    assert os.access(script, os.X_OK), f"{script} is not executable"
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _run_sbatch(tmp_path: Path, *extra: str, **env_overrides: str) -> subprocess.CompletedProcess:
    bin_dir = _fake_bin(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "FAKE_OUT": str(out),
        "SLURM_JOB_NODELIST": "gpu-a[01-04]",
        "SLURM_JOB_ID": "4242",
        "SLURM_SUBMIT_DIR": str(tmp_path / "submit"),
        "SLURM_CPUS_ON_NODE": "128",
        "MODEL_PATH": "/shared/models/DeepSeek-V4-Flash",
        "DSV4RL_DATA_DIR": "/shared/data",
        **env_overrides,
    }
    return subprocess.run(
        ["bash", str(SBATCH), *extra], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )


def test_sbatch_command_composes_and_validates_on_every_node(tmp_path: Path, monkeypatch) -> None:
    result = _run_sbatch(tmp_path, "+comm.env.NCCL_SOCKET_IFNAME=eth0")
    assert result.returncode == 0, result.stderr
    srun_args = (tmp_path / "out" / "srun-args").read_text().splitlines()
    assert "--kill-on-bad-exit=1" in srun_args and "--ntasks-per-node=1" in srun_args
    assert "--cpus-per-task=128" in srun_args
    run_dir = tmp_path / "submit" / "runs" / "dapo_math-4242"
    assert run_dir.is_dir()
    # The recipe reads DSV4RL_DATA_DIR (the script only requires it): compose in the job's environment.
    monkeypatch.setenv("DSV4RL_DATA_DIR", "/shared/data")
    for var in ("MASTER_ADDR", "SLURM_NODEID"):
        monkeypatch.delenv(var, raising=False)
    plans = {}
    for node in range(4):
        argv = json.loads((tmp_path / "out" / f"node-{node}.json").read_text())
        assert argv[0] == "train"
        recipe, overrides = _split_recipe(argv[1:])
        assert recipe == "dapo_math"
        cfg = compose(recipe, overrides)
        validate(cfg, check_paths=False)
        c = cfg.cluster
        assert (c.node_rank, c.master_addr, c.node_addrs) == (node, "gpu-a01", HOSTS)
        assert cfg.model.path == "/shared/models/DeepSeek-V4-Flash" and cfg.run.dir == str(run_dir)
        assert cfg.data.path == "/shared/data/dapo_math_17k.parquet"
        assert cfg.comm.env["NCCL_SOCKET_IFNAME"] == "eth0" and cfg.comm.env["NCCL_MIN_NCHANNELS"] == "16"
        plans[node] = (build_local_plan(cfg, run_dir, base_env={}), remote_engine_health(cfg))
        urls = engine_urls(cfg)
    assert urls == [
        "http://gpu-a03:30000",
        "http://gpu-a03:30001",
        "http://gpu-a04:30000",
        "http://gpu-a04:30001",
    ]
    for node in (0, 1):
        (trainer,), waits = plans[node]
        assert trainer.role == "trainer" and len(waits) == 4
    for node in (2, 3):
        engines, waits = plans[node]
        assert [s.role for s in engines] == ["engine", "engine"] and waits == []
        assert all(s.argv[s.argv.index("--host") + 1] == "0.0.0.0" for s in engines)


def test_sbatch_requires_model_path(tmp_path: Path) -> None:
    result = _run_sbatch(tmp_path, MODEL_PATH="")
    assert result.returncode != 0 and "set MODEL_PATH" in result.stderr
    assert not (tmp_path / "out" / "srun-args").exists()


def test_local_cpu_script_runs_tiny_arith(tmp_path: Path) -> None:
    bin_dir = _fake_bin(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    env = {
        "PATH": "/usr/bin:/bin",
        "FAKE_OUT": str(out),
        "DSV4RL": str(bin_dir / "dsv4rl"),
        "RUN_DIR": "runs/x",
    }
    result = subprocess.run(
        ["bash", str(LOCAL), "train.steps=3"], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    argv = json.loads((out / "node-local.json").read_text())
    recipe, overrides = _split_recipe(argv[1:])
    cfg = compose(recipe, overrides)
    validate(cfg, check_paths=True)
    assert (argv[0], cfg.recipe, cfg.run.dir, cfg.train.steps) == ("train", "tiny_arith", "runs/x", 3)


def test_gpu_check_dry_run_plans_one_sglang_engine_per_format(tmp_path: Path) -> None:
    """Without a GPU the check runs its trainer half on the CPU (the same script, gloo) and validates and
    plans each engine run: real SGLang flags, the tiny FP8-expert checkpoint's environment, the engine
    interpreter; on a GPU the same arguments go to `dsv4rl align`. fp8_mxfp4, which validation refuses with
    SGLang (no MoE runner of 0.5.23 updates MXFP4 experts in place), is named and refused."""
    env = {
        **os.environ,
        "DRY_RUN": "1",
        "OUT": str(tmp_path / "out"),
        "PYTHON": sys.executable,
        "DSV4RL": str(Path(sys.executable).with_name("dsv4rl")),
        "SGLANG_PYTHON": "/opt/sglang/bin/python",
        "FORMATS": "bf16 fp8_rollout fp8_mxfp4",
    }
    result = subprocess.run(["bash", str(GPU_CHECK)], capture_output=True, text=True, env=env, timeout=600)
    report = json.loads(result.stdout)
    assert report["dry_run"] is True and list(report["formats"]) == ["bf16", "fp8_rollout", "fp8_mxfp4"]
    trainer = report["trainer"]
    assert trainer["ok"] and trainer["device"] == "cpu", trainer
    assert trainer["checkpoint_resume"]["max_abs_diff_after_one_more_step"] == 0.0
    assert trainer["bf16_parity"]["bfloat16"]["median_abs_diff"] < 0.015
    refused = report["formats"].pop("fp8_mxfp4")
    assert result.returncode == 1 and not refused["ok"], result.stdout + result.stderr
    assert "SGLANG_DSV4_FP4_DEQUANT=1" in "\n".join(refused["error"])
    for name, entry in report["formats"].items():
        argv = entry["engine_argv"]
        assert entry["ok"] and entry["warnings"] == [], (name, entry)
        assert argv[:3] == ["/opt/sglang/bin/python", "-m", "sglang.launch_server"]
        assert "--enable-deterministic-inference" in argv
        assert argv[argv.index("--dtype") + 1] == "bfloat16"
        # bf16, and the tiny FP8-expert checkpoint: the backend is free, triton re-lays nothing out
        assert argv[argv.index("--moe-runner-backend") + 1] == "triton"
    assert report["formats"]["fp8_rollout"]["engine_env"] == {
        "SGLANG_OPT_FP8_WO_A_GEMM": "0",
        "SGLANG_DSV4_FP4_EXPERTS": "0",
    }


def test_gpu_check_without_sglang_checks_the_trainer_and_says_sglang_was_not(tmp_path: Path) -> None:
    """A machine without SGLang (no interpreter at SGLANG_PYTHON) runs the trainer half and reports the
    engine half as skipped instead of failing on it. Here the trainer half runs on the CPU (no GPU)."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable,
           "SGLANG_PYTHON": str(tmp_path / "no-sglang" / "python"), "TRAINER_PORT": "29631"}  # fmt: skip
    result = subprocess.run(["bash", str(GPU_CHECK)], capture_output=True, text=True, env=env, timeout=600)
    report = json.loads(result.stdout)
    assert result.returncode == 0 and report["trainer"]["ok"], result.stdout + result.stderr
    assert report["formats"] == {} and "SGLang not checked" in report["engines_skipped"]
