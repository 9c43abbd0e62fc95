"""Routing and indexer replay on transformers' DeepSeek-V4: with the replay, a trainer whose weights differ
from the engine's chooses exactly the engine's experts and indexer entries on every token, and its router
still gets a gradient; hash-routed layers agree without any replay."""

from __future__ import annotations

import copy

import pytest
import torch

from dsv4rl.config.model_schema import ModelConfig, TinyModelConfig
from dsv4rl.model.replay import (
    NO_CHOICE,
    ChoiceRecorder,
    ReplayCounts,
    differs,
    hash_routed_layers,
    indexer_layers,
    replay_metrics,
    replaying,
    score_routed_layers,
)
from dsv4rl.model.tiny import build_tiny_model

VOCAB = 31
# index_topk 2 of up to 12 entries: the indexer really selects (the default keeps every entry)
TINY = TinyModelConfig(index_topk=2)


@pytest.fixture(scope="module")
def engine_model() -> torch.nn.Module:
    return build_tiny_model(ModelConfig(tiny=TINY), VOCAB)


def perturbed(model: torch.nn.Module, scale: float = 0.3) -> torch.nn.Module:
    """A copy whose routers, indexers and projections differ: it would choose differently."""
    other = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, parameter in other.named_parameters():
            if parameter.dim() == 2 and ("gate" in name or "indexer" in name or "q_a_proj" in name):
                parameter.add_(scale * parameter.std() * torch.randn(parameter.shape, generator=generator))
    return other


def tokens(batch: int = 3, length: int = 48) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(0))


def recorded(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    recorder = ChoiceRecorder(model, routed=True, indexer=True)
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
        return recorder.take()
    finally:
        recorder.close()


def test_recorder_layout_follows_sglang(engine_model: torch.nn.Module) -> None:
    config = engine_model.config
    routes, topk = recorded(engine_model, tokens())
    assert routes.dtype == topk.dtype == torch.int32
    assert routes.shape == (3, 48, config.num_hidden_layers, config.num_experts_per_tok)
    assert topk.shape == (3, 48, len(indexer_layers(config)), config.index_topk)
    for layer in hash_routed_layers(config):  # SGLang never captures hash-routed layers: zeros
        assert not routes[:, :, layer].any()
    # the first queries see no compressed entry yet: all -1
    assert (topk[:, :3] == -1).all()


def test_without_replay_the_perturbed_trainer_chooses_differently(engine_model: torch.nn.Module) -> None:
    ids = tokens()
    routes, topk = recorded(engine_model, ids)
    own_routes, own_topk = recorded(perturbed(engine_model), ids)
    score = score_routed_layers(engine_model.config)
    assert differs(own_routes[:, :, score], routes[:, :, score]).any()
    assert differs(own_topk, topk).any()


def test_with_replay_every_choice_is_the_engines(engine_model: torch.nn.Module) -> None:
    ids = tokens()
    routes, topk = recorded(engine_model, ids)
    trainer = perturbed(engine_model)
    counts = ReplayCounts()
    with replaying(trainer, routes, topk, counts):
        seen_routes, seen_topk = recorded(trainer, ids)  # hooks added after the replay's see its result
    score = score_routed_layers(engine_model.config)
    assert not differs(seen_routes[:, :, score], routes[:, :, score]).any()
    assert not differs(seen_topk, topk).any()
    assert counts.routed_total == ids.numel() * len(score)
    assert counts.indexer_total == ids.numel() * len(indexer_layers(engine_model.config))
    assert 0 < counts.routed_differ < counts.routed_total
    assert 0 < counts.indexer_differ < counts.indexer_total
    metrics = replay_metrics(counts, routing=True, indexer=True)
    assert metrics["routing_replay_diff_fraction"] == counts.routed_differ / counts.routed_total
    assert 0 < metrics["indexer_replay_diff_fraction"] < 1


def test_replay_of_the_same_model_changes_nothing(engine_model: torch.nn.Module) -> None:
    ids = tokens()
    routes, topk = recorded(engine_model, ids)
    with torch.no_grad():
        plain = engine_model(input_ids=ids, use_cache=False).logits
        counts = ReplayCounts()
        with replaying(engine_model, routes, topk, counts):
            replayed = engine_model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(replayed, plain, rtol=0, atol=1e-6)
    assert counts.routed_differ == counts.indexer_differ == 0


def test_routing_weights_come_from_the_trainers_scores_and_get_gradients(
    engine_model: torch.nn.Module,
) -> None:
    ids = tokens(batch=2, length=24)
    routes, _ = recorded(engine_model, ids)
    trainer = perturbed(engine_model)
    layer = score_routed_layers(trainer.config)[0]
    gate = trainer.model.layers[layer].mlp.gate
    seen = {}
    handle = gate.register_forward_hook(lambda module, args, output: seen.update(out=output))
    with replaying(trainer, routes, None):
        trainer(input_ids=ids, use_cache=False).logits.sum().backward()
    handle.remove()
    logits, weights, chosen = seen["out"]
    scores = gate.score_fn(logits.detach()).gather(1, chosen)
    expected = scores / scores.sum(dim=-1, keepdim=True) * gate.routed_scaling_factor
    torch.testing.assert_close(weights.detach(), expected)
    assert gate.weight.grad is not None and gate.weight.grad.abs().sum() > 0


def test_positions_without_a_rollout_row_keep_the_trainers_choice(engine_model: torch.nn.Module) -> None:
    ids = tokens(batch=1, length=32)
    trainer = perturbed(engine_model)
    own_routes, own_topk = recorded(trainer, ids)
    routes, topk = recorded(engine_model, ids)
    routes[:, 20:], topk[:, 20:] = NO_CHOICE, NO_CHOICE  # e.g. the last token and the padding
    with replaying(trainer, routes, topk):
        seen_routes, seen_topk = recorded(trainer, ids)
    score = score_routed_layers(trainer.config)
    assert not differs(seen_routes[:, 20:, score], own_routes[:, 20:, score]).any()
    assert not differs(seen_topk[:, 20:], own_topk[:, 20:]).any()
    assert not differs(seen_routes[:, :20, score], routes[:, :20, score]).any()


def test_hash_routed_layers_agree_without_replay(engine_model: torch.nn.Module) -> None:
    """Hash routing looks the experts up by token id: whatever the weights, engine and trainer agree."""
    ids = tokens()
    config = engine_model.config
    assert hash_routed_layers(config)
    trainer = perturbed(engine_model, scale=2.0)
    seen = {}
    for model, key in ((engine_model, "engine"), (trainer, "trainer")):
        hooks = [
            model.model.layers[layer].mlp.gate.register_forward_hook(
                lambda module, args, output, key=key, layer=layer: seen.__setitem__((key, layer), output[2])
            )
            for layer in hash_routed_layers(config)
        ]
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
        for hook in hooks:
            hook.remove()
    for layer in hash_routed_layers(config):
        assert torch.equal(seen[("engine", layer)], seen[("trainer", layer)])
        table = engine_model.model.layers[layer].mlp.gate.tid2eid
        assert torch.equal(seen[("engine", layer)], table[ids.reshape(-1)])
