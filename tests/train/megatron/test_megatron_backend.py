"""MegatronBackend under torchrun (gloo, CPU): at world size 1 against the FSDP backend on the same
batches, at TP=2, PP=2 and EP=2 against world size 1, and its checkpoints (backend_scenarios.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from test_megatron_model import collect, launch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fsdp"))  # the scenarios' shared checks
from fsdp_scenarios import check_nonfinite  # noqa: E402

SCRIPT = Path(__file__).with_name("backend_scenarios.py")
# (tensor, pipeline, expert, last stage layers); the recompute modes ride along (they change no number)
LAYOUTS = {"tp2": (2, 1, 1, None), "pp2": (1, 2, 1, 1), "ep2": (1, 1, 2, None)}
FLAGS = {"pp2": ("--recompute", "full", "2"), "ep2": ("--recompute", "selective")}


def _run(root: Path, name: str, layout: tuple, *flags: str) -> dict:
    out = root / name
    out.mkdir()
    args = [str(out), *(str(v) for v in layout if v is not None), *flags]
    world = layout[0] * layout[1] * layout[2]
    return collect({name: (launch(SCRIPT, world, args), out / "results.pt")})[name]


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    return _run(tmp_path_factory.mktemp("megatron_backend"), "w1", (1, 1, 1, None), "--with-fsdp")


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("megatron_layouts")
    out = {name: _run(root, name, layout, *FLAGS.get(name, ())) for name, layout in LAYOUTS.items()}
    # a checkpoint written at TP=2 loads at world size 1 (megatron's distributed checkpoint reshards)
    out["tp2_loaded_at_w1"] = _run(root, "load", (1, 1, 1, None), "--load", out["tp2"]["checkpoint"])
    return out


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max(float((a[name].double() - b[name].double()).abs().max()) for name in b)


def _assert_metrics_close(mine: list[dict], reference: list[dict]) -> None:
    for step, (a, b) in enumerate(zip(mine, reference, strict=True)):
        for key, value in b.items():
            assert a[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (step, key, a[key], value)


def test_export_equals_the_fsdp_backend_bit_for_bit(single):
    exported, reference = single["megatron_initial"], single["fsdp_initial"]
    assert set(exported) == set(reference)
    for name, tensor in reference.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


def test_training_matches_the_fsdp_backend(single):
    assert single["data_parallel"] == (0, 1)
    assert (single["megatron_logprobs"] - single["fsdp_logprobs"]).abs().max() < 1e-5
    _assert_metrics_close(single["megatron_metrics"], single["fsdp_metrics"])
    assert _max_difference(single["megatron_after"], single["fsdp_after"]) < 1e-5
    assert _max_difference(single["megatron_after"], single["megatron_initial"]) > 1e-4  # it trained


def test_checkpoint_round_trip(single):
    assert single["extra"] == {"cursor": 7} and single["reloaded_step"] == 2
    assert _max_difference(single["reloaded"], single["megatron_after"]) == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_parallel_layout_trains_like_world_one(single, layouts, layout):
    result = layouts[layout]
    assert result["data_parallel"][1] == (2 if layout == "ep2" else 1)  # EP is carved out of DP
    assert _max_difference(result["megatron_initial"], single["megatron_initial"]) == 0.0
    assert (result["megatron_logprobs"] - single["megatron_logprobs"]).abs().max() < 1e-5
    _assert_metrics_close(result["megatron_metrics"], single["megatron_metrics"])
    assert _max_difference(result["megatron_after"], single["megatron_after"]) < 1e-5
    assert _max_difference(result["reloaded"], result["megatron_after"]) == 0.0


@pytest.mark.slow
def test_checkpoint_loads_at_another_layout(layouts):
    loaded = layouts["tp2_loaded_at_w1"]
    assert loaded["extra"] == {"cursor": 7}
    assert _max_difference(loaded["loaded"], layouts["tp2"]["megatron_after"]) == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_each_stage_source_yields_its_own_stage(single, layouts, layout):
    """`by_stage`: the first rank of each pipeline stage yields exactly that stage's tensors, and together
    they are the export through rank 0, bit for bit (PP=2: the last layer, norm and head come from rank 1)."""
    result = layouts[layout]
    sources, by_stage = result["megatron_sources"], result["megatron_by_stage"]
    assert sorted(by_stage) == sources == ([0, 1] if layout == "pp2" else [0])
    merged = {name: tensor for sent in by_stage.values() for name, tensor in sent.items()}
    assert sum(len(sent) for sent in by_stage.values()) == len(merged)  # no tensor from two stages
    after = result["megatron_after"]
    assert set(merged) == set(after)
    assert all(merged[name].dtype == t.dtype and torch.equal(merged[name], t) for name, t in after.items())
    if layout == "pp2":
        assert any(n.startswith("model.layers.2.") for n in by_stage[1])
        assert not any(n.startswith("model.layers.2.") for n in by_stage[0])
        assert "lm_head.weight" in by_stage[1] and "model.embed_tokens.weight" in by_stage[0]
    single_by_stage = single["fsdp_by_stage"]
    assert list(single_by_stage) == [0] and set(single_by_stage[0]) == set(single["fsdp_after"])


def test_nonfinite_steps_are_skipped_then_stop_naming_the_tensor(single):
    """Megatron at world 1: the skip leaves weights and Adam's state bit for bit, the stop names the
    tensor (megatron's parameter names), checkpoints are marked finite and a NaN weight is never saved."""
    check_nonfinite(single["nonfinite"], world=1)
    saved = torch.load(Path(single["checkpoint"]) / "trainer_state.pt", weights_only=True)
    assert saved["finite"] is True and saved["step"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_nonfinite_steps_are_skipped_at_every_layout(layouts, layout):
    """TP=2, PP=2 (the loss only on the last stage), EP=2 (two data-parallel replicas): all ranks agree."""
    check_nonfinite(layouts[layout]["nonfinite"], world=2)
