"""Routing and indexer replay in the fsdp backend (one rank, in-process): with the replays on, the experts
the trainer's MoE layers run and the entries its CSA attention reads are the engine's on every token,
although the engine's weights differ; metrics report the share of replayed decisions that differed."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dsv4rl.config.model_schema import ModelConfig, TinyModelConfig
from dsv4rl.config.schema import Config
from dsv4rl.model.model_dir import materialize_model
from dsv4rl.model.replay import ChoiceRecorder, indexer_layers, score_routed_layers
from dsv4rl.samples import Sample
from dsv4rl.train.batch import TrainBatch

TINY = TinyModelConfig(index_topk=2)  # the indexer keeps 2 of up to 10 entries: choices can flip


@pytest.fixture
def world_of_one(tmp_path: Path):  # noqa: ANN201
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def engine_of(model: torch.nn.Module) -> torch.nn.Module:
    """The 'engine': the trainer's weights with its routers and indexers perturbed (as rounding would)."""
    engine = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in engine.named_parameters():
            if parameter.dim() == 2 and ("gate" in name or "indexer" in name):
                parameter.add_(0.3 * parameter.std() * torch.randn(parameter.shape, generator=generator))
    return engine


def rollout(engine: torch.nn.Module, count: int = 6) -> list[Sample]:
    """Samples with the engine's choices of every forwarded position, as the rollout keeps them."""
    generator = torch.Generator().manual_seed(11)
    recorder = ChoiceRecorder(engine, routed=True, indexer=True)
    samples = []
    for index in range(count):
        prompt = torch.randint(
            3, 31, (int(torch.randint(20, 30, (1,), generator=generator)),), generator=generator
        )
        response = torch.randint(
            3, 31, (int(torch.randint(5, 12, (1,), generator=generator)),), generator=generator
        )
        sequence = torch.cat([prompt, response])
        with torch.no_grad():
            engine(input_ids=sequence[None, :-1], use_cache=False)
        routes, topk = recorder.take()
        rows = len(sequence) - 1
        samples.append(
            Sample(
                index // 2,
                prompt.tolist(),
                response.tolist(),
                [-1.0] * len(response),
                "",
                "stop",
                advantage=1.0 if index % 2 else -1.0,
                routed_experts=routes[0].reshape(rows, -1).numpy(),
                indexer_topk=topk[0].reshape(rows, -1).numpy(),
            )
        )
    recorder.close()
    return samples


def used_choices(model: torch.nn.Module) -> tuple[dict, dict, list]:
    """Hooks that record what the forward actually used: the experts each score-routed layer ran, and the
    compressed entries each CSA layer's attention could read (block bias 0)."""
    experts, entries, handles = {}, {}, []
    config = model.config
    for layer in score_routed_layers(config):
        handles.append(
            model.model.layers[layer].mlp.experts.register_forward_pre_hook(
                lambda module, args, layer=layer: experts.setdefault(layer, []).append(args[1].detach())
            )
        )
    for layer in indexer_layers(config):
        handles.append(
            model.model.layers[layer].self_attn.compressor.register_forward_hook(
                lambda module, args, output, layer=layer: entries.setdefault(layer, []).append(
                    output[1][:, 0].detach() == 0
                )
            )
        )
    return experts, entries, handles


def expected_choices(batch: TrainBatch, config) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    b, t = batch.input_ids.shape
    routes = batch.routed_experts.view(b, t, config.num_hidden_layers, -1)
    topk = batch.indexer_topk.view(b, t, len(indexer_layers(config)), -1)
    return routes, topk


@pytest.mark.parametrize("replay_on", [True, False])
def test_the_trainer_runs_the_engines_choices(world_of_one, tmp_path: Path, replay_on: bool) -> None:  # noqa: ANN001
    from dsv4rl.train.fsdp.backend import FSDPBackend

    cfg = Config()
    cfg.model = ModelConfig(tiny=TINY)
    cfg.optim.lr = 1e-3
    cfg.train.micro_batch_size = 3
    cfg.algo.routing_replay = cfg.algo.indexer_replay = replay_on
    path = materialize_model(cfg.model, str(tmp_path / "tiny"))
    backend = FSDPBackend(cfg, path, torch.device("cpu"))
    batch = TrainBatch.from_samples(rollout(engine_of(backend.model)), pad_id=2)
    experts, entries, handles = used_choices(backend.model)
    metrics = backend.train_step(batch, temperature=1.0)
    for handle in handles:
        handle.remove()

    config = backend.hf_config
    routes, topk = expected_choices(batch, config)
    mismatched_routes = mismatched_entries = 0
    for start, micro in zip(range(0, batch.size, 3), range(2), strict=True):
        width = None
        for layer in score_routed_layers(config):
            used = experts[layer][micro].sort(dim=-1).values
            rows = used.shape[0] // 3
            want = routes[start : start + 3, :rows, layer].reshape(-1, used.shape[-1]).long()
            present = (want >= 0).all(dim=-1)
            assert present.any()
            mismatched_routes += int((used[present] != want[present].sort(dim=-1).values).any(-1).sum())
            width = rows
        for slot, layer in enumerate(indexer_layers(config)):
            seen = entries[layer][micro]  # [3, S, entries]
            want = topk[start : start + 3, :width, slot].long()
            for row in range(3):
                for position in range(width):
                    picks = want[row, position]
                    if (picks == -2).any():  # no rollout row: the last token, the padding
                        continue
                    chosen = set(seen[row, position].nonzero().flatten().tolist())
                    mismatched_entries += chosen != set(picks[picks >= 0].tolist())
    if replay_on:
        assert mismatched_routes == 0 and mismatched_entries == 0
        assert 0 < metrics["routing_replay_diff_fraction"] < 1
        assert 0 < metrics["indexer_replay_diff_fraction"] < 1
        total = sum(len(s.prompt_ids) + len(s.response_ids) - 1 for s in rollout(engine_of(backend.model)))
        assert metrics["routing_replay_decisions"] == total * len(score_routed_layers(config))
    else:  # the same weights without the replay choose differently: the test can fail
        assert mismatched_routes > 0 and mismatched_entries > 0
        assert "routing_replay_diff_fraction" not in metrics
