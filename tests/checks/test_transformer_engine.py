"""`precision_aware_optimizer` needs Transformer Engine where megatron's optimizer is built: on a training
node with a GPU. Refused there without it (both fixes named), not on a CPU machine or a rollout node."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from dsv4rl.checks import machine
from dsv4rl.checks.validate import validate
from dsv4rl.config.compose import compose
from dsv4rl.config.schema import Config


@pytest.fixture
def dapo() -> Config:
    return compose("dapo_math")  # megatron, precision-aware with CPU offload, 8 GPUs a node


@pytest.fixture
def without_te(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # import raises ImportError


def _problems(cfg: Config) -> list[str]:
    found: list[str] = []
    machine.check_transformer_engine(cfg, found.append)
    return found


def test_refused_on_a_gpu_training_node_without_te(dapo, without_te, monkeypatch) -> None:
    monkeypatch.setattr(machine, "gpu_visible", lambda: True)
    (problem,) = _problems(dapo)
    assert "parallel.train.precision_aware_optimizer=false" in problem
    assert "make install GPU=1" in problem and "ROCm" in problem and "ModuleNotFoundError" in problem


def test_not_applicable_where_megatron_builds_no_optimizer_of_its_own(dapo, without_te, monkeypatch) -> None:
    monkeypatch.setattr(machine, "gpu_visible", lambda: False)
    assert _problems(dapo) == []  # CPU: torch's AdamW
    validate(dapo, check_paths=False)
    monkeypatch.setattr(machine, "gpu_visible", lambda: True)
    dapo.cluster.node_rank = 2  # a rollout node: no trainer
    assert _problems(dapo) == []
    dapo.cluster.node_rank = 0
    dapo.parallel.train.precision_aware_optimizer = False
    assert _problems(dapo) == []


def test_te_that_imports_passes(dapo, monkeypatch) -> None:
    monkeypatch.setattr(machine, "gpu_visible", lambda: True)
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    assert _problems(dapo) == []  # with offload megatron reads only TE's version
    dapo.parallel.train.optimizer_cpu_offload = False
    dapo.parallel.train.optimizer_offload_fraction = 0.0
    assert "FusedAdam" in _problems(dapo)[0] or "transformer_engine.pytorch" in _problems(dapo)[0]


def test_a_gpu_is_looked_for_in_torch_only_where_a_drivers_device_node_exists(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(machine, "GPU_DEVICE_NODES", (str(tmp_path / "nvidiactl"), str(tmp_path / "kfd")))
    assert not machine.gpu_visible()  # no node: torch is not asked (and not imported by a CLI process)
    (tmp_path / "kfd").touch()
    assert machine.gpu_visible()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not machine.gpu_visible()  # a node without a working driver: torch's answer stands
