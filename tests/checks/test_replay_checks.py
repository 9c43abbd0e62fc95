"""algo.routing_replay / algo.indexer_replay: refused, with the fix named, where they cannot work."""

from __future__ import annotations

from recipe_problems import recipe_problems as problems


def test_the_tiny_recipe_takes_both_replays() -> None:
    assert problems("tiny_arith", "algo.routing_replay=true", "algo.indexer_replay=true") == []


def test_routing_replay_needs_a_score_routed_layer() -> None:
    found = problems(
        "tiny_arith", "algo.routing_replay=true", "model.tiny.mlp_layer_types=[hash_moe,hash_moe,hash_moe]"
    )
    assert any("no score-routed layer" in p and "need no replay" in p for p in found)


def test_indexer_replay_needs_a_csa_layer() -> None:
    layers = "model.tiny.layer_types=[sliding_attention,sliding_attention,heavily_compressed_attention]"
    found = problems("tiny_arith", "algo.indexer_replay=true", layers)
    assert any(
        "algo.indexer_replay=true" in p and "no 'compressed_sparse_attention' layer" in p for p in found
    )


def test_both_backends_take_the_replays() -> None:
    both = ("algo.routing_replay=true", "algo.indexer_replay=true")
    assert problems("tiny_arith", *both, "parallel.train.backend=megatron") == []


def test_sglang_indexer_replay_needs_attention_tp_of_one() -> None:
    found = problems("dapo_math", "algo.indexer_replay=true")
    assert any("attention TP size 1" in p for p in found)
    dp = "parallel.rollout.data_parallel={}"
    tp = problems("dapo_math", "algo.indexer_replay=true", "parallel.rollout.tensor_parallel=4", dp.format(4))
    assert not any("attention TP size 1" in p for p in tp)
