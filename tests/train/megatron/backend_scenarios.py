"""Run under torchrun (gloo on CPU, NCCL on GPUs): MegatronBackend at a parallel layout on the tiny
checkpoint.
Writes OUT/results.pt on rank 0 for tests/train/megatron/test_megatron_backend.py; the non-finite guard
runs as in tests/train/fsdp/fsdp_scenarios.py.

Usage: backend_scenarios.py OUT TP PP EP [LAST_STAGE_LAYERS] [--with-fsdp] [--load CHECKPOINT]
                           [--recompute MODE [N]]
At world size 1, `--with-fsdp` also runs the FSDP backend on the same batches (the reference).
`--load CHECKPOINT` only loads a checkpoint (written at any layout) and exports the weights.
`--recompute MODE [N]` trains with activation recompute (full: N blocks per chunk, or selective).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fsdp"))  # the FSDP scenarios' helpers
from fsdp_scenarios import config, make_batch, nonfinite  # noqa: E402

from dsv4rl.config.choices import RecomputeMode, TrainBackend
from dsv4rl.config.schema import Config
from dsv4rl.model.model_dir import materialize_model  # noqa: E402
from dsv4rl.train.backend import build_backend  # noqa: E402
from dsv4rl.train.checkpoint import checkpoint_dir  # noqa: E402


def megatron_config(tensor: int, pipeline: int, expert: int, last: int | None, **over) -> Config:
    cfg = config(**over)
    train = cfg.parallel.train
    train.backend = TrainBackend.megatron
    train.tensor_parallel, train.pipeline_parallel, train.expert_parallel = tensor, pipeline, expert
    train.last_stage_layers = last
    cfg.train.micro_batch_size = 2  # several micro-batches per mini-batch: the pipeline schedule runs
    if "--recompute" in sys.argv:  # --recompute MODE [BLOCKS PER CHUNK]
        at = sys.argv.index("--recompute")
        train.recompute = RecomputeMode(sys.argv[at + 1])
        if len(sys.argv) > at + 2 and sys.argv[at + 2].isdigit():
            train.recompute_granularity_layers = int(sys.argv[at + 2])
    return cfg


def synced(backend) -> dict[str, torch.Tensor]:  # noqa: ANN001
    return {name: tensor.clone().cpu() for name, tensor in backend.named_weights_for_sync()}


def synced_by_stage(backend) -> dict[int, dict[str, torch.Tensor]]:  # noqa: ANN001
    """What each rank yields with `by_stage` (a source: its own stage), gathered to every rank."""
    mine = {name: tensor.clone().cpu() for name, tensor in backend.named_weights_for_sync(by_stage=True)}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {rank: sent for rank, sent in enumerate(every) if sent}


def run(backend, batches: list, out: dict, prefix: str) -> None:  # noqa: ANN001
    out[f"{prefix}_initial"] = synced(backend)
    out[f"{prefix}_logprobs"] = backend.compute_logprobs(batches[0].input_ids).cpu()
    metrics = []
    for batch in batches:
        shard = batch.shard(backend.data_parallel_rank, backend.data_parallel_size, num_mini_batches=2)
        metrics.append(backend.train_step(shard, temperature=0.9))
    out[f"{prefix}_metrics"] = metrics
    out[f"{prefix}_after"] = synced(backend)
    out[f"{prefix}_by_stage"] = synced_by_stage(backend)
    out[f"{prefix}_sources"] = list(backend.weight_source_ranks)


def main() -> None:
    out_dir = Path(sys.argv[1])
    tensor, pipeline, expert = (int(a) for a in sys.argv[2:5])
    last = int(sys.argv[5]) if len(sys.argv) > 5 and sys.argv[5].isdigit() else None
    with_fsdp = "--with-fsdp" in sys.argv
    # on a GPU machine the same scenario runs the CUDA path: NCCL, megatron's distributed optimizer
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    model_dir = out_dir / "model"
    if rank == 0:
        materialize_model(Config().model, str(model_dir))
    dist.barrier()
    # the loss features on: 2 updates per step, KL to a reference, entropy bonus, TIS; weight decay
    # (both backends spare the same parameters: dsv4rl.train.weight_decay)
    features = dict(
        algo__updates_per_step=2,
        algo__kl_coef=0.1,
        algo__entropy_coef=0.01,
        algo__tis__enabled=True,
        optim__eps=1e-4,
        optim__weight_decay=0.1,
    )
    batches = [make_batch(8, seed=10 + step) for step in range(2)]
    results: dict = {"sizes": (tensor, pipeline, expert)}
    if "--load" in sys.argv:
        cfg = megatron_config(tensor, pipeline, expert, last, **features)
        backend = build_backend(cfg, str(model_dir), None)
        results["extra"] = backend.load_checkpoint(sys.argv[sys.argv.index("--load") + 1])
        results["loaded"] = synced(backend)
        if rank == 0:
            torch.save(results, out_dir / "results.pt")
        dist.barrier()
        dist.destroy_process_group()
        return

    backend = build_backend(megatron_config(tensor, pipeline, expert, last, **features), str(model_dir), None)
    results["data_parallel"] = (backend.data_parallel_rank, backend.data_parallel_size)
    run(backend, batches, results, "megatron")
    root = out_dir / "ckpt"
    saved = backend.save_checkpoint(str(checkpoint_dir(root, backend.step)), {"cursor": 7})
    results["checkpoint"] = str(saved)
    # train on, then load the checkpoint back: the weights return to the saved ones
    backend.train_step(
        batches[0].shard(backend.data_parallel_rank, backend.data_parallel_size, 2), temperature=0.9
    )
    extra = backend.load_checkpoint(str(saved))
    results["extra"] = extra
    results["reloaded"] = synced(backend)
    results["reloaded_step"] = backend.step
    del backend

    # the non-finite guard (fsdp_scenarios.nonfinite): one update per step, the layout's own ranks
    guarded = megatron_config(
        tensor, pipeline, expert, last, train__max_nonfinite_steps=2, optim__warmup_steps=10
    )
    backend = build_backend(guarded, str(model_dir), None)
    replica = (backend.data_parallel_rank, backend.data_parallel_size)
    # (no finite save: megatron's is slow, and the checkpoint above carries the mark the tests read)
    results["nonfinite"] = nonfinite(backend, lambda b: b.shard(*replica), out_dir / "nonfinite", save=False)
    del backend

    if with_fsdp:
        cfg = config(**features)
        cfg.train.micro_batch_size = 2
        fsdp = build_backend(cfg, str(model_dir), None)
        run(fsdp, batches, results, "fsdp")
    if rank == 0:
        torch.save(results, out_dir / "results.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
