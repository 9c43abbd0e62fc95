"""Run under torchrun (gloo, CPU): a MegatronBackend at TP/PP/EP trains one step on the tiny model and
writes a checkpoint, the way a run does; rank 0 saves the trainer's log-probs and its own export of the
weights at that checkpoint, for tests/export/test_export_megatron.py.

Usage: checkpoint_export_scenarios.py OUT TP PP EP
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fsdp"))  # the FSDP scenarios' helpers
from fsdp_scenarios import config, make_batch  # noqa: E402

from dsv4rl.config.choices import TrainBackend
from dsv4rl.config.schema import Config
from dsv4rl.model.model_dir import materialize_model  # noqa: E402
from dsv4rl.train.backend import build_backend  # noqa: E402
from dsv4rl.train.checkpoint import checkpoint_dir  # noqa: E402


def main() -> None:
    out_dir = Path(sys.argv[1])
    tensor, pipeline, expert = (int(a) for a in sys.argv[2:5])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model_dir = out_dir / "model"
    if rank == 0:
        materialize_model(Config().model, str(model_dir))
    dist.barrier()
    cfg = config()
    train = cfg.parallel.train
    train.backend = TrainBackend.megatron
    train.tensor_parallel, train.pipeline_parallel, train.expert_parallel = tensor, pipeline, expert
    cfg.train.micro_batch_size = 2
    backend = build_backend(cfg, str(model_dir), None)
    batch = make_batch(8, seed=3)
    shard = batch.shard(backend.data_parallel_rank, backend.data_parallel_size, num_mini_batches=1)
    backend.train_step(shard, temperature=1.0)
    probe = make_batch(4, seed=5).input_ids
    logprobs = backend.compute_logprobs(probe)
    weights = {name: t.clone().cpu() for name, t in backend.named_weights_for_sync()}
    saved = backend.save_checkpoint(str(checkpoint_dir(out_dir / "run" / "checkpoints", backend.step)), {})
    if rank == 0:
        torch.save(
            {"checkpoint": str(saved), "probe": probe, "logprobs": logprobs.cpu(), "weights": weights},
            out_dir / "results.pt",
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
