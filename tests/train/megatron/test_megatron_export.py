"""The megatron backend's weight export gathers a stage's tensor- and expert-parallel pieces onto the stage's
sending rank only: the other ranks allocate nothing while they send theirs (at DeepSeek-V4-Flash's size
every rank of a stage used to hold each layer's routed experts, ~21 GB, while only the sender needed them).
torchrun, 2 processes, EP=2 then TP=2 (export_scenarios.py); the export through rank 0 equals the FSDP
backend's bit for bit in test_megatron_backend.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_megatron_model import collect, launch

SCRIPT = Path(__file__).with_name("export_scenarios.py")
LAYOUTS = ("ep2", "tp2")


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("megatron_export")
    return collect({"export": (launch(SCRIPT, 2, [str(out)]), out / "results.pt")})["export"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_export_allocates_nothing_on_the_rank_that_does_not_send(exports, layout):
    sender, other = exports[layout]
    assert sender["sources"] == [0]  # one stage: rank 0 sends it
    for mode in ("by_stage", "rank0"):
        assert other[mode]["tensors"] == {} and other[mode]["bytes"] == 0, mode
    # the counter sees what a rank gathers: every rank holding everything allocates it all
    assert other["every_rank"]["bytes"] == sender["every_rank"]["bytes"] > 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_sender_exports_the_whole_stage_one_merged_tensor_at_a_time(exports, layout):
    sender, _ = exports[layout]
    reference = sender["every_rank"]["tensors"]
    stacked = [t for name, t in reference.items() if name.endswith(("gate_up_proj", "down_proj"))]
    for mode in ("by_stage", "rank0"):
        got = sender[mode]["tensors"]
        assert list(got) == list(reference)  # the same tensors in the same order
        assert all(got[name].dtype == t.dtype and torch.equal(got[name], t) for name, t in reference.items())
        # no allocation beyond one merged tensor: the experts land in their stacked tensor directly
        assert sender[mode]["largest"] <= max(t.numel() * t.element_size() for t in reference.values())
        assert sender[mode]["bytes"] <= sender["every_rank"]["bytes"]
    assert stacked and all(t.shape[0] == 8 for t in stacked)  # the tiny model's 8 experts, stacked
