"""A setting megatron-core cannot build fails at validation, not after every rank has loaded its weights:
every shipped recipe with every shipped parallel layout, on either backend, is refused by `dsv4rl.checks`
(the Transformer Engine rule as on a GPU node) or builds megatron's own TransformerConfig,
DistributedDataParallelConfig and OptimizerConfig through the backend's `megatron_configs`, for a CPU and
for a GPU; on the tiny model the optimizer is constructed as far as this machine allows
(`megatron_configs.py`, in a process of its own)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("megatron_configs.py")
sys.path.insert(0, str(SCRIPT.parent))
from megatron_configs import cases  # noqa: E402

RECIPE_KEY = re.compile(r"\b(parallel|cluster|model|sync|engine|optim|algo|train|quant|comm|data|eval)\.\w+")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> dict[tuple[str, str, str], dict]:
    out = tmp_path_factory.mktemp("megatron_configs") / "cases.jsonl"
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(out)], capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    parsed = [json.loads(line) for line in out.read_text().splitlines()]
    return {(row["recipe"], row["layout"], row["backend"]): row for row in parsed}


def test_megatron_configs_cover_every_recipe_and_layout(rows) -> None:
    assert set(rows) == set(cases())
    assert ("dapo_math", "flash_4node_disagg", "megatron") in rows
    assert {recipe for recipe, _, _ in rows} >= {"dapo_math", "tiny_arith"}


def test_megatron_configs_build_for_every_recipe(rows) -> None:
    """What validation lets through builds on both devices; what does not build was refused."""
    for key, row in rows.items():
        if key[2] != "megatron":
            continue
        failed = {device: error for device, error in row["built"].items() if error is not None}
        if row["problems"]:
            continue  # refused (the refusals are named: test_megatron_configs_refusals_name_a_key)
        assert not failed, f"{key} validates but megatron cannot build it: {failed}"
        assert "construct_error" not in row, f"{key}: {row['construct_error']}"


def test_megatron_configs_construct_the_optimizer_on_cpu(rows) -> None:
    """On the tiny model: torch's AdamW on CPU, and megatron's distributed optimizer built up to its first
    CUDA tensor (config, parameter groups with dsv4rl's decay overrides, the inner optimizer)."""
    built = [row for row in rows.values() if "cpu_optimizer" in row]
    assert {(row["recipe"], row["layout"]) for row in built} >= {("tiny_arith", "cpu_single")}
    for row in built:
        assert row["cpu_optimizer"] == "ModelParallelAdamW"
        assert row["gpu_optimizer"] == "built" or row["gpu_optimizer"].startswith("stopped for CUDA at"), row


def test_megatron_configs_refusals_name_a_key(rows) -> None:
    for key, row in rows.items():
        for problem in row["problems"]:
            assert RECIPE_KEY.search(problem), f"{key}: {problem}"


def test_megatron_configs_precision_aware_needs_transformer_engine(rows) -> None:
    """dapo_math's layout asks for megatron's precision-aware optimizer. Without Transformer Engine
    megatron's config raises (the refusal is needed), the refusal names both fixes, and the fix builds."""
    row = rows[("dapo_math", "flash_4node_disagg", "megatron")]
    if importlib.util.find_spec("transformer_engine") is not None:
        assert row["problems"] == [] and row["built"] == {"cpu": None, "gpu": None}
        return
    assert row["built"]["cpu"] is None  # on CPU the backend steps with torch's AdamW
    assert row["built"]["gpu"].startswith("TypeError"), row["built"]  # None >= Version, after loading
    (problem,) = row["problems"]
    assert "parallel.train.precision_aware_optimizer=false" in problem and "make install GPU=1" in problem
    assert row["fixed"] == {"cpu": None, "gpu": None}
