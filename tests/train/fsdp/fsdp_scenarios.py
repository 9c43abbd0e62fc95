"""Run under torchrun (world 1 or 2, gloo on CPU): exercises FSDPBackend and writes results for
tests/train/fsdp/test_fsdp_backend.py to compare.
Usage: fsdp_scenarios.py OUT_DIR [--resume-from OTHER_OUT_DIR]

With --resume-from, only one scenario runs: resume from the step-4 checkpoint that a run at the other
world size wrote in OTHER_OUT_DIR (one rank keeps a plain module, two ranks shard it), then train a step."""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from dsv4rl.config.schema import Config
from dsv4rl.model.model_dir import materialize_model
from dsv4rl.rollout.types import Sample
from dsv4rl.train.batch import TrainBatch
from dsv4rl.train.checkpoint import checkpoint_dir, latest_checkpoint
from dsv4rl.train.fsdp.backend import FSDPBackend

PAD = 2


def make_batch(n: int, seed: int, adv: list[float] | None = None) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        p = int(torch.randint(2, 6, (1,), generator=g))
        r = int(torch.randint(1, 9, (1,), generator=g))
        ids = torch.randint(4, 27, (p + r,), generator=g).tolist()
        lps = (-1.0 - torch.rand(r, generator=g)).tolist()
        a = adv[i] if adv is not None else float(torch.randn(1, generator=g))
        samples.append(Sample(i // 4, ids[:p], ids[p:], lps, "", "stop", advantage=a))
    return TrainBatch.from_samples(samples, PAD)


def config(**over) -> Config:
    cfg = Config()
    cfg.optim.lr = 1e-3
    cfg.optim.grad_clip = 1.0
    cfg.train.micro_batch_size = 3
    for key, value in over.items():
        obj = cfg
        *path, last = key.split("__")
        for part in path:
            obj = getattr(obj, part)
        setattr(obj, last, value)
    return cfg


def gather_rows(t: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def synced(backend: FSDPBackend) -> dict[str, torch.Tensor]:
    return {k: v.clone().cpu() for k, v in backend.named_weights_for_sync()}


def resume_across_worlds(out: Path, other: Path) -> None:
    """Resume from the other world size's step-4 checkpoint and from this run's own, and train one step
    of the same batch from each (own-world resume is exact: test_checkpoint_resume_is_exact)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    res: dict = {}
    for source, root in (("other", other), ("own", out)):
        backend = FSDPBackend(config(optim__warmup_steps=4, train__keep_checkpoints=2), str(root / "model"))
        extra = backend.load_checkpoint(str(checkpoint_dir(root / "ckpt", 4)))
        res[source] = {"step": backend.step, "extra": extra, "loaded": synced(backend)}
        res[source]["metrics"] = backend.train_step(make_batch(8, seed=40).shard(rank, world))
        res[source]["trained"] = synced(backend)
        del backend
    if rank == 0:
        torch.save(res, out / f"resumed_world{world}.pt")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if sys.argv[2:3] == ["--resume-from"]:
        resume_across_worlds(out, Path(sys.argv[3]))
        return
    model_dir = out / "model"
    if rank == 0:
        materialize_model(Config().model, str(model_dir))
    dist.barrier()
    res: dict = {"world": world}

    # 1. logprobs vs an unsharded model; 2. a positive advantage raises that sequence's logprob
    backend = FSDPBackend(config(), str(model_dir))
    res["sharded"] = backend.sharded
    res["initial_weights"] = synced(backend)
    batch = make_batch(8, seed=1, adv=[1.0, 0, 0, 0, 0, 0, 0, 0])
    mine = batch.shard(rank, world)
    res["logprobs"] = gather_rows(backend.compute_logprobs(mine.input_ids))
    res["batch_ids"] = batch.input_ids
    # uneven batches (5 vs 1 sequences, micro-batches of 3): ranks must not deadlock
    rows = slice(0, 5) if rank == 0 else slice(5, 6)
    uneven = backend.compute_logprobs(batch.input_ids[rows])
    diffs = [None] * world
    dist.all_gather_object(diffs, float((uneven - res["logprobs"][rows]).abs().max()))
    res["uneven_diffs"] = diffs
    res["mask"] = batch.loss_mask
    backend.train_step(mine, temperature=1.0)
    res["logprobs_after"] = gather_rows(backend.compute_logprobs(mine.input_ids))
    n = len(list(backend.named_weights_for_sync()))
    counts = [None] * world
    dist.all_gather_object(counts, n)
    res["yield_counts"] = counts
    del backend

    # 3. every feature on: 2 updates, micro-batches of 3, KL to a reference, entropy bonus, TIS, MIS
    # Adam eps 1e-4: Adam's sign-like update of near-zero gradients would amplify float noise
    # (summation order differs with the world size) far beyond 1e-5; grad_norm checks the scale.
    full = config(
        algo__updates_per_step=2,
        algo__kl_coef=0.1,
        algo__entropy_coef=0.01,
        optim__warmup_steps=4,
        optim__eps=1e-4,
        optim__grad_clip=0.5,
    )
    full.algo.tis.enabled = True
    full.algo.mis.enabled = True  # the batches' rollout log-probs are -1..-2, the model's about -3.3:
    full.algo.mis.low, full.algo.mis.high = 0.15, 10.0  # these bounds drop some tokens, not all
    backend = FSDPBackend(full, str(model_dir))
    metrics = []
    for step in range(2):
        b = make_batch(8, seed=10 + step).shard(rank, world, num_mini_batches=2)
        metrics.append(backend.train_step(b, temperature=0.9))
    res["full_metrics"] = metrics
    res["full_weights"] = synced(backend)
    del backend

    # 3b. one update per rollout batch: the old log-probs from the training forward, or from the separate
    # old-policy forward (today's path before the shortcut): the same weights and metrics
    on_policy = config(algo__kl_coef=0.1, algo__entropy_coef=0.01, optim__eps=1e-4)
    on_policy.algo.tis.enabled = True
    on_policy.algo.mis.enabled = True
    on_policy.algo.mis.low, on_policy.algo.mis.high = 0.15, 10.0
    for reuse in (True, False):
        backend = FSDPBackend(on_policy, str(model_dir))
        backend.reuse_policy_forward = reuse
        forwards = []
        backend.model.register_forward_pre_hook(lambda *_, seen=forwards: seen.append(1))
        metrics = [backend.train_step(make_batch(8, seed=30 + i).shard(rank, world)) for i in range(3)]
        res[f"on_policy_{reuse}"] = (synced(backend), metrics, len(forwards))
        del backend

    # 4. checkpoint: train 2, save, train 2 -> W; load into a fresh backend, train the same 2 -> W
    ck = config(optim__warmup_steps=4, train__keep_checkpoints=2)
    root = out / "ckpt"
    batches = [make_batch(8, seed=20 + i).shard(rank, world) for i in range(4)]
    backend = FSDPBackend(ck, str(model_dir))
    for i in range(2):
        backend.train_step(batches[i])
        backend.save_checkpoint(str(checkpoint_dir(root, backend.step)), {"cursor": 100 + i, "rank": rank})
    torch.manual_seed(1234 + rank)
    random.seed(99)
    np.random.seed(7)
    expected_rng = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(1234 + rank)
    random.seed(99)
    np.random.seed(7)
    # the same step again: the checkpoint is overwritten
    backend.save_checkpoint(str(checkpoint_dir(root, backend.step)), {"cursor": 101, "rank": rank})
    lrs = [backend.train_step(b)["lr"] for b in batches[2:]]
    res["ckpt_weights_a"] = synced(backend)
    backend.save_checkpoint(str(checkpoint_dir(root, backend.step)), {"cursor": 103, "rank": rank})
    del backend
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    backend = FSDPBackend(ck, str(model_dir))
    extra = backend.load_checkpoint(str(checkpoint_dir(root, 2)))
    got_rng = (torch.rand(3), random.random(), np.random.rand())
    res["rng_restored"] = bool(torch.equal(got_rng[0], expected_rng[0])) and got_rng[1:] == expected_rng[1:]
    res["extra"] = extra
    res["loaded_step"] = backend.step
    lrs_b = [backend.train_step(b)["lr"] for b in batches[2:]]
    res["lrs"] = (lrs, lrs_b)
    res["ckpt_weights_b"] = synced(backend)
    res["latest"] = str(latest_checkpoint(root))
    res["ckpt_listing"] = sorted(p.name for p in root.iterdir())
    flags = [None] * world
    dist.all_gather_object(flags, (res["rng_restored"], extra))
    res["per_rank_restore"] = flags
    del backend

    # 5. timing (optional): 128 sequences x ~12 tokens
    if os.environ.get("DSV4RL_BENCH"):
        backend = FSDPBackend(config(train__micro_batch_size=64), str(model_dir))
        big = make_batch(128, seed=5).shard(rank, world)
        backend.train_step(big)
        t0 = time.perf_counter()
        for _ in range(3):
            backend.train_step(big)
        res["bench_s"] = (time.perf_counter() - t0) / 3
        res["bench_tokens"] = big.input_ids.shape

    if rank == 0:
        torch.save(res, out / f"results_world{world}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
