"""Routing and indexer replay in the megatron backend (torchrun, gloo; replay_scenarios.py does the work):
with the replays on, the experts every score router chooses and the entries every CSA indexer keeps are
the engine's on every token, at world size 1, at TP=2 (the router sees its rank's share of the tokens)
and with full recompute (the block reruns in backward); without them the same weights choose otherwise."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_megatron_model import collect, launch

from dsv4rl.model.replay import NO_CHOICE

SCRIPT = Path(__file__).with_name("replay_scenarios.py")

RUNS = {"w1": ("1", "1"), "tp2": ("2", "1"), "w1_off": ("1", "0"), "w1_full": ("1", "1", "full")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:  # noqa: ANN001
    root = tmp_path_factory.mktemp("megatron_replay")
    procs = {}
    for name, args in RUNS.items():
        out = root / name
        out.mkdir()
        procs[name] = (launch(SCRIPT, int(args[0]), [str(out), *args]), out / "results.pt")
    return collect(procs)


def mismatches(result: dict) -> tuple[int, int, int]:
    """(routing decisions that differ from the rollout's, indexer decisions that differ, checked)."""
    batch = result["batch"]
    b, t = batch.input_ids.shape
    routes = batch.routed_experts.view(b, t, 3, -1)
    topk = batch.indexer_topk.view(b, t, 1, -1)
    width = batch.trimmed_width() + 1  # input positions of the trimmed micro-batches
    micro = 3
    count = b // micro
    bad_routes = bad_entries = checked = 0
    for name, calls in result["routes"].items():
        layer = int(re.search(r"layers\.(\d+)\.", name).group(1))
        per_micro = len(calls) // count  # 2 with full recompute: the block reruns in backward
        for index, chosen in enumerate(calls):
            rows = slice(index // per_micro * micro, (index // per_micro + 1) * micro)
            want = routes[rows, :width, layer].reshape(-1, routes.shape[-1]).long()
            chosen = chosen[: want.shape[0]]  # TP pads the tokens to a multiple of the TP size
            present = (want != NO_CHOICE).all(dim=-1)
            checked += int(present.sum())
            differ = chosen.sort(dim=-1).values != want.sort(dim=-1).values
            bad_routes += int((differ.any(dim=-1) & present).sum())
    for calls in result["entries"].values():
        per_micro = len(calls) // count
        for index, mask in enumerate(calls):
            rows = slice(index // per_micro * micro, (index // per_micro + 1) * micro)
            want = topk[rows, :width, 0].long()
            for row in range(micro):
                for position in range(width):
                    picks = want[row, position]
                    if (picks == NO_CHOICE).any():
                        continue
                    kept = set(mask[row, position].nonzero().flatten().tolist())
                    bad_entries += kept != set(picks[picks >= 0].tolist())
    return bad_routes, bad_entries, checked


@pytest.mark.slow
@pytest.mark.parametrize("name", ["w1", "tp2", "w1_full"])
def test_every_choice_is_the_engines(runs: dict, name: str) -> None:
    bad_routes, bad_entries, checked = mismatches(runs[name])
    assert checked > 0
    assert (bad_routes, bad_entries) == (0, 0)
    metrics = runs[name]["metrics"]
    assert 0 < metrics["routing_replay_diff_fraction"] < 1
    assert 0 < metrics["indexer_replay_diff_fraction"] < 1


@pytest.mark.slow
def test_without_replay_the_choices_differ(runs: dict) -> None:
    bad_routes, bad_entries, _ = mismatches(runs["w1_off"])
    assert bad_routes > 0 and bad_entries > 0
    assert "routing_replay_diff_fraction" not in runs["w1_off"]["metrics"]


@pytest.mark.slow
def test_replay_metrics_agree_across_layouts(runs: dict) -> None:
    """The same batch and weights: each layout counts the same share of differing decisions."""
    reference = runs["w1"]["metrics"]
    for name in ("tp2", "w1_full"):
        metrics = runs[name]["metrics"]
        for key in ("routing_replay_diff_fraction", "indexer_replay_diff_fraction"):
            assert metrics[key] == pytest.approx(reference[key], abs=1e-9), (name, key)


def test_a_replayed_selection_keeps_exactly_the_rollouts_entries() -> None:
    """Padding (-1) and a single visible entry 0 in one row: entry 0 stays kept (no lost scatter)."""
    import torch

    from dsv4rl.model.replay import ReplayCounts
    from dsv4rl.train.megatron.replay import replayed_selection, selection_mask
    from dsv4rl.train.megatron.sparse_attention import EntrySelection

    own = EntrySelection(torch.tensor([[[1, 2], [0, 1], [2, 0]]]), torch.ones(1, 3, 2, dtype=torch.bool), 4)
    replayed = torch.tensor([[[0, -1], [NO_CHOICE, NO_CHOICE], [2, 1]]])
    counts = ReplayCounts()
    chosen = replayed_selection(own, replayed, entries=3, counts=counts)
    kept = selection_mask(chosen, 3)
    assert kept.tolist() == [[[True, False, False], [True, True, False], [False, True, True]]]
    assert chosen.indices.shape == own.indices.shape
    assert (counts.indexer_differ, counts.indexer_total) == (2, 2)
