"""The launch scripts: valid bash, and the commands they run compose and validate with their recipes.

The sbatch script runs here under fake `scontrol` and `srun` (srun starts the task command once per node
with SLURM_NODEID set) and a fake `dsv4rl` that records its arguments; each node's arguments are then
composed and validated, and the node plans are checked against the fake hostnames.
"""

from __future__ import annotations

import contextlib
import importlib.util
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
from dsv4rl.model.native_checkpoint import checkpoint_format

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
    assert urls == ["http://gpu-a03:30000", "http://gpu-a04:30000"]  # one TP8 engine per rollout node
    for node in (0, 1):
        (trainer,), waits = plans[node]
        assert trainer.role == "trainer" and len(waits) == 2
    for node in (2, 3):
        engines, waits = plans[node]
        assert [s.role for s in engines] == ["engine"] and waits == []
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


def gpu_check_summary_module():
    spec = importlib.util.spec_from_file_location(
        "gpu_check_summary", GPU_CHECK.with_name("gpu_check_summary.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def conforms(value: object, schema: dict, where: str = "summary") -> None:
    """The parts of JSON Schema the summary's schema uses: type, const, enum, required, properties, items."""
    types = {"object": dict, "array": list, "string": str, "integer": int, "number": (int, float),
             "boolean": bool, "null": type(None)}  # fmt: skip
    if "const" in schema:
        assert value == schema["const"], where
    if "enum" in schema:
        assert value in schema["enum"], where
    if "type" in schema:
        allowed = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        assert any(isinstance(value, types[t]) for t in allowed), (where, value)
    if isinstance(value, dict):
        for key in schema.get("required", []):
            assert key in value, f"{where}.{key} is missing"
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                conforms(value[key], sub, f"{where}.{key}")
    if isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            conforms(item, schema["items"], f"{where}[{index}]")


def test_gpu_check_dry_run_prints_the_checks_for_one_and_two_gpus_and_the_schema(tmp_path: Path) -> None:
    """`launch/gpu_check.sh --dry-run` on a machine without a GPU: the checks of 1 GPU (the trainer, the
    colocated push) and of 2+ (the broadcast push too), each push check planned by `dsv4rl plan`: the
    engine and trainer placement and transport of each path, the reference format's MXFP4 checkpoint
    de-quantized at load; then the summary's JSON schema."""
    env = {
        **os.environ,
        "OUT": str(tmp_path / "out"),
        "PYTHON": sys.executable,
        "DSV4RL": str(Path(sys.executable).with_name("dsv4rl")),
        "SGLANG_PYTHON": "/opt/sglang/bin/python",
        "DEVICE": "h200",
    }
    result = subprocess.run(["bash", str(GPU_CHECK), "--dry-run"], capture_output=True, text=True, env=env,
                            timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["dry_run"] is True and (report["cluster_device"], report["comm"]) == ("h200", "nccl_h100")
    names = {label: [c["name"] for c in checks] for label, checks in report["checks"].items()}
    one = ["trainer", "colocated_push.fp8_rollout", "colocated_push.bf16"]
    assert names == {"1": one, "2+": [*one, "broadcast_push.fp8_rollout", "broadcast_push.bf16"]}
    checks = {c["name"]: c for c in report["checks"]["2+"]}
    assert checks["trainer"]["command"].endswith("launch/gpu_check_trainer.py OUT/trainer")
    for name, check in checks.items():
        if name == "trainer":
            continue
        placed = (check["transport"], check["engine_gpus"], check["trainer_gpus"])
        assert check["plan_ok"] and check["warnings"] == [], (name, check)
        argv = check["engine_argv"]
        assert argv[:3] == ["/opt/sglang/bin/python", "-m", "sglang.launch_server"], name
        assert check["command"][:2] == ["dsv4rl", "align"] and check["command"][-1] == "--json"
        if name.startswith("colocated_push"):
            assert check["path"].startswith("colocated:") and "tensor handles" in check["path"]
            assert placed == ("tensor", "0..0", "0..0")
            assert "--enable-memory-saver" in argv
        else:
            assert check["path"].startswith("disaggregated:") and "NCCL/RCCL" in check["path"]
            assert placed == ("broadcast", "0..0", "1")
        assert check["bounds"] == report["logprob_bounds"][check["format"]], name
        if name.endswith("fp8_rollout"):  # the reference recipe's format, from a release-format checkpoint
            assert check["engine_env"]["SGLANG_DSV4_FP4_DEQUANT"] == "1"
            assert "SGLANG_DSV4_FP4_EXPERTS" not in check["engine_env"]
            model = argv[argv.index("--model-path") + 1]
            assert checkpoint_format(model).experts == "mxfp4", model
            assert argv[argv.index("--moe-runner-backend") + 1] == "auto"  # SGLang demands it (fp8.py:425)
    schema = report["summary_schema"]
    assert {"gpus", "device", "ok", "checks", "skipped"} <= set(schema["required"])
    assert set(schema["properties"]["checks"]["items"]["required"]) >= {"name", "path", "ok", "figures"}


def test_the_summary_is_one_json_object_of_the_schema(tmp_path: Path) -> None:
    """Built from a run's result files: each check passed or not with its figures (or its log's tail),
    and what was skipped and why."""
    summary = gpu_check_summary_module()
    (tmp_path / "trainer").mkdir()
    trainer = {"ok": True, "device": "NVIDIA H200", **{key: {"ok": True} for key in summary.TRAINER_CHECKS}}
    (tmp_path / "trainer" / "trainer.json").write_text(json.dumps(trainer))
    (tmp_path / "trainer.rc").write_text("0\n")
    align = {
        "mean_abs_diff": 0.004,
        "p99_abs_diff": 0.02,
        "max_abs_diff": 0.05,
        "tokens": 512,
        "sync": {"seconds": 0.8, "bytes": 2_000_000, "tensors": 155, "buckets": 1, "transport": "tensor"},
    }
    (tmp_path / "colocated_push.fp8_rollout.json").write_text(json.dumps(align))
    (tmp_path / "colocated_push.fp8_rollout.rc").write_text("0\n")
    (tmp_path / "colocated_push.bf16.rc").write_text("1\n")
    (tmp_path / "colocated_push.bf16.log").write_text("Traceback ...\nRuntimeError: CUDA error\n")
    args = ["summary", str(tmp_path), "--gpus", "1", "--device", "NVIDIA H200", "--cluster-device", "h200",
            "--comm", "nccl_h100", "--shape", "tiny", "--sglang", ".venv-sglang/bin/python", "--engines", "1",
            "--formats", "fp8_rollout", "bf16"]  # fmt: skip
    report_path = tmp_path / "summary.json"
    with report_path.open("w") as out, contextlib.redirect_stdout(out):
        code = summary.main(args)
    report = json.loads(report_path.read_text())
    conforms(report, summary.SUMMARY_SCHEMA)
    assert code == 1 and report["ok"] is False
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["colocated_push.fp8_rollout"]["figures"] == {
        "push_s": 0.8, "push_bytes": 2_000_000, "push_tensors": 155, "push_buckets": 1, "transport": "tensor",
        "logprob_mean_abs_diff": 0.004, "logprob_p99_abs_diff": 0.02, "logprob_max_abs_diff": 0.05,
        "tokens": 512,
    }  # fmt: skip
    assert [checks[name]["status"] for name in checks] == ["passed", "passed", "failed"]
    assert checks["colocated_push.fp8_rollout"]["bounds"] == summary.LOGPROB_BOUNDS["fp8_rollout"]
    assert checks["colocated_push.bf16"]["error"][0] == "dsv4rl align exited 1"
    assert checks["colocated_push.bf16"]["error"][-1] == "RuntimeError: CUDA error"
    assert [s["name"] for s in report["skipped"]] == ["broadcast_push.fp8_rollout", "broadcast_push.bf16"]
    assert report["skipped"][0]["why"] == "needs 2 GPU(s), 1 visible"


def test_gpu_check_without_sglang_checks_the_trainer_and_says_sglang_was_not(tmp_path: Path) -> None:
    """A machine without SGLang (no interpreter at SGLANG_PYTHON) runs the trainer check and reports the
    push checks as skipped instead of failing on them. Here the trainer runs on the CPU (no GPU)."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable, "GPUS": "1",
           "SGLANG_PYTHON": str(tmp_path / "no-sglang" / "python"), "TRAINER_PORT": "29631"}  # fmt: skip
    result = subprocess.run(["bash", str(GPU_CHECK)], capture_output=True, text=True, env=env, timeout=600)
    report = json.loads(result.stdout)
    assert result.returncode == 0 and report["ok"], result.stdout + result.stderr
    assert [c["name"] for c in report["checks"]] == ["trainer"] and report["checks"][0]["status"] == "passed"
    figures = report["checks"][0]["figures"]  # each of its checks measured, under the bounds it names
    assert (
        figures["bf16_parity"]["bfloat16"]["median_abs_diff"]
        < figures["bf16_parity"]["bounds"]["bfloat16_median_abs_diff"]
    )
    assert figures["nonfinite_skip"]["max_abs_diff_to_unskipped_bound"] > 0
    skipped = {s["name"]: s["why"] for s in report["skipped"]}
    assert "no SGLang interpreter" in skipped["colocated_push.fp8_rollout"]
    assert skipped["broadcast_push.bf16"] == "needs 2 GPU(s), 1 visible"
