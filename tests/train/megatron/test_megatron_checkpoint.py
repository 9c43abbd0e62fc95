"""The megatron backend's checkpoints describe megatron's distributed optimizer with `is_loading=True` when
they load and without when they save. megatron allocates a fresh optimizer's state only under
`is_loading` (`megatron/core/optimizer/distrib_optimizer.py:1264`); without it the moments of an optimizer
that has not stepped are not in what loads (or, precision-aware with offload, 'master_param' is missing).

megatron's DistributedOptimizer cannot be built without CUDA (`megatron/core/optimizer/optimizer.py:481`),
so its place is taken by a mock with the signature of megatron's own classes (`create_autospec`): a call
the real class would refuse fails here too. The rest is the real save and load path at world size 1.
"""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from megatron.core.optimizer import ChainedOptimizer, DistributedOptimizer

from dsv4rl.train.megatron import checkpoint
from dsv4rl.train.megatron.optimizer import MegatronDistributedAdam


@pytest.fixture
def world_of_one(tmp_path: Path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _Model:
    def sharded_state_dict(self) -> dict:
        return {"weight": torch.zeros(1)}

    def load_state_dict(self, state: dict) -> None:
        assert "weight" in state


def _megatron_adam(cls: type) -> tuple[MegatronDistributedAdam, mock.MagicMock]:
    """The backend's wrapper around a stand-in for megatron's optimizer of class `cls`."""
    inner = mock.create_autospec(cls, instance=True)
    inner.sharded_state_dict.return_value = {"param_state": {}}
    optimizer = MegatronDistributedAdam.__new__(MegatronDistributedAdam)
    optimizer.optimizer, optimizer.weight_decay = inner, 0.0
    return optimizer, inner


@pytest.mark.parametrize("cls", [DistributedOptimizer, ChainedOptimizer])  # dense only / dense + experts
def test_distributed_optimizer_state_is_described_for_loading_on_load(
    world_of_one, tmp_path, cls, monkeypatch
):
    optimizer, inner = _megatron_adam(cls)
    saved: list[dict] = []
    monkeypatch.setattr(checkpoint.dist_checkpointing, "save", lambda state, path: saved.append(state))
    monkeypatch.setattr(checkpoint.dist_checkpointing, "load", lambda state, path: state)

    final = checkpoint.save_checkpoint(
        _Model(), optimizer, {"step": 3, "updates": 6}, str(tmp_path / "c"), {}
    )
    assert inner.sharded_state_dict.call_args.kwargs == {"is_loading": False}
    assert saved[0]["optimizer"] == {"param_state": {}}

    counters, extra = checkpoint.load_checkpoint(_Model(), optimizer, str(final))
    assert inner.sharded_state_dict.call_args.kwargs == {"is_loading": True}
    inner.load_state_dict.assert_called_once_with({"param_state": {}})
    assert counters == {"step": 3, "updates": 6} and extra == {}


def test_a_checkpoint_whose_frozen_tensors_this_run_trains_is_refused(world_of_one, tmp_path, monkeypatch):
    """train.freeze is recorded; resuming with a tensor it froze now trained would need Adam state the
    checkpoint never had (megatron loads an optimizer's state only whole): refused, naming both settings."""
    optimizer, _ = _megatron_adam(DistributedOptimizer)
    monkeypatch.setattr(checkpoint.dist_checkpointing, "save", lambda state, path: None)
    monkeypatch.setattr(checkpoint.dist_checkpointing, "load", lambda state, path: state)
    gates = ["model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"]
    frozen = checkpoint.Frozen(["router_gate"], gates)
    final = checkpoint.save_checkpoint(
        _Model(), optimizer, {"step": 2, "updates": 2}, str(tmp_path / "c"), {}, 0, frozen
    )
    state = torch.load(final / checkpoint.TRAINER_STATE, weights_only=True)
    assert (state["freeze"], state["frozen"]) == (["router_gate"], gates)

    with pytest.raises(ValueError) as error:
        checkpoint.load_checkpoint(_Model(), optimizer, str(final), checkpoint.Frozen([], []))
    assert "written with train.freeze=['router_gate'], and train.freeze=[] trains 2 of the tensors" in str(
        error.value
    )
    frozen_more = checkpoint.Frozen(
        ["router_gate", "router_bias"], [*gates, "model.layers.1.mlp.gate.e_score_correction_bias"]
    )
    assert checkpoint.load_checkpoint(_Model(), optimizer, str(final), frozen_more)[0] == {
        "step": 2,
        "updates": 2,
    }
