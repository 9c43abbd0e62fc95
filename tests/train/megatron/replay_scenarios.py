"""Run under torchrun (gloo on CPU): MegatronBackend trains one step on a batch whose routing and indexer
choices come from an 'engine' with perturbed routers and indexers; records what the megatron model's
score routers and CSA indexers chose (gathered over TP) and writes OUT/results.pt on rank 0 for
tests/train/megatron/test_megatron_replay.py.

Usage: replay_scenarios.py OUT TP REPLAY(0|1) [RECOMPUTE]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from dsv4rl.config.choices import RecomputeMode, TrainBackend
from dsv4rl.config.model_schema import ModelConfig, TinyModelConfig
from dsv4rl.config.schema import Config
from dsv4rl.model.model_dir import materialize_model
from dsv4rl.model.native_checkpoint import load_native_model
from dsv4rl.model.replay import ChoiceRecorder
from dsv4rl.samples import Sample
from dsv4rl.train.backend import build_backend
from dsv4rl.train.batch import TrainBatch
from dsv4rl.train.megatron.compressor import Indexer
from dsv4rl.train.megatron.moe import ScoreRouter
from dsv4rl.train.megatron.replay import selection_mask

TINY = TinyModelConfig(index_topk=2)


def engine_batch(model_dir: str) -> TrainBatch:
    """Samples as the rollout keeps them, from an engine whose routers and indexers are perturbed."""
    engine = load_native_model(model_dir, torch.float32).eval()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in engine.named_parameters():
            if parameter.dim() == 2 and ("gate" in name or "indexer" in name):
                parameter.add_(0.3 * parameter.std() * torch.randn(parameter.shape, generator=generator))
    recorder = ChoiceRecorder(engine, routed=True, indexer=True)
    samples = []
    for index in range(6):
        prompt = torch.randint(3, 31, (20 + 2 * index,), generator=generator)
        response = torch.randint(3, 31, (6 + index,), generator=generator)
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
    return TrainBatch.from_samples(samples, pad_id=2)


def record(model: torch.nn.Module) -> dict:
    """Wrap every score router's `choose` and every indexer's `select`: what they returned, in call order."""
    seen: dict = {"routes": {}, "entries": {}}
    for name, module in model.named_modules():
        if isinstance(module, ScoreRouter):
            choose = module.choose

            def wrapped_choose(scores, choose=choose, name=name):  # noqa: ANN001, ANN202
                chosen = choose(scores)
                seen["routes"].setdefault(name, []).append(chosen.detach().clone())
                return chosen

            module.choose = wrapped_choose
        elif isinstance(module, Indexer):
            select = module.select

            def wrapped_select(hidden, *args, select=select, name=name, ratio=module.ratio):  # noqa: ANN001, ANN202
                selection = select(hidden, *args)
                mask = selection_mask(selection, hidden.shape[1] // ratio)
                seen["entries"].setdefault(name, []).append(mask.clone())
                return selection

            module.select = wrapped_select
    return seen


def gathered(chunks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each call's [tokens of this rank, k] gathered over every rank (the TP split of the tokens)."""
    out = []
    for chunk in chunks:
        parts = [torch.empty_like(chunk) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, chunk.contiguous())
        out.append(torch.cat(parts))
    return out


def main() -> None:
    out_dir, tensor, replay_on = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = Config()
    cfg.model = ModelConfig(tiny=TINY)
    cfg.optim.lr = 1e-3
    cfg.train.micro_batch_size = 3
    cfg.parallel.train.backend = TrainBackend.megatron
    cfg.parallel.train.tensor_parallel = tensor
    if len(sys.argv) > 4:
        cfg.parallel.train.recompute = RecomputeMode(sys.argv[4])
    cfg.algo.routing_replay = cfg.algo.indexer_replay = replay_on
    model_dir = out_dir / "model"
    if rank == 0:
        materialize_model(cfg.model, str(model_dir))
    dist.barrier()
    batch = engine_batch(str(model_dir))
    backend = build_backend(cfg, str(model_dir), None)
    seen = record(backend.ddp)
    metrics = backend.train_step(batch, temperature=1.0)
    results = {
        "batch": batch,
        "metrics": metrics,
        "routes": {name: gathered(calls) for name, calls in sorted(seen["routes"].items())},
        "entries": seen["entries"],
        "tensor": tensor,
    }
    if rank == 0:
        torch.save(results, out_dir / "results.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
