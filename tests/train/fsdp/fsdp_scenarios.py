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
import pytest
import torch
import torch.distributed as dist

from dsv4rl.config.schema import Config
from dsv4rl.model.model_dir import materialize_model
from dsv4rl.samples import Sample
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


def everywhere(value: object) -> list:
    """`value` from every rank, in rank order."""
    values: list = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def local_state(backend) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """Copies of this rank's weights and optimizer state (shards): what a skipped step must not change."""
    out = {f"weight {name}": tensor.detach().clone() for name, tensor in backend.local_weights()}
    optimizer = getattr(backend.optimizer, "optimizer", backend.optimizer)  # megatron's CPU AdamW: torch's
    for index, state in enumerate(optimizer.state.values()):
        for key, value in state.items():
            local = value.to_local() if hasattr(value, "to_local") else value
            out[f"optimizer {index} {key}"] = local.detach().clone()
    return out


def bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def poison_gradients(backend, name: str | None) -> None:  # noqa: ANN001
    """A gradient hook: after each backward, an Inf in this rank's shard of the gradient `name`, where this
    rank holds one (None: no more)."""
    backend.__dict__.pop("forward_backward", None)
    if name is None:
        return
    original = backend.forward_backward

    def forward_backward(micro, loss):  # noqa: ANN001, ANN202
        sums = original(micro, loss)
        grad = dict(backend.local_gradients()).get(name)
        if grad is not None and grad.numel():
            with torch.no_grad():
                grad[(0,) * grad.dim()] = float("inf")
        return sums

    backend.forward_backward = forward_backward


def nonfinite(backend, shard, root: Path, save: bool = True) -> dict:  # noqa: ANN001
    """The non-finite guard on either backend (`train.max_nonfinite_steps=2`, lr warmup over 10 optimizer
    steps so the schedule's position shows): a NaN advantage and an Inf gradient skip the step with the
    weights and optimizer state bit for bit as before; the third skip in a row stops naming the tensor;
    with the limit at 0 a NaN loss stops at once; non-finite weights are never checkpointed (`save`: a
    finite checkpoint is written first and its mark read back)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {"metrics": []}

    def step(seed: int, nan_advantage: bool = False) -> None:
        batch = make_batch(8, seed=seed)
        if nan_advantage:
            batch.advantages[0] = float("nan")  # the first row: rank 0's share (one replica's only)
        out["metrics"].append(backend.train_step(shard(batch)))

    def stopped(seed: int, nan_advantage: bool = False) -> dict:
        try:
            step(seed, nan_advantage)
        except Exception as error:  # noqa: BLE001  (the test reads the type and the message)
            found = {key: getattr(error, key, None) for key in ("step", "phase", "tensor")}
            return {"type": type(error).__name__, "message": str(error), **found}
        return {"type": None}

    step(50)  # a finite step first: Adam's state exists
    before = local_state(backend)
    step(51, nan_advantage=True)
    out["advantage_skip"] = everywhere(bit_identical(before, local_state(backend)))
    out["counters"] = [(backend.step, backend.updates, backend.nonfinite_in_a_row)]
    step(52)  # finite again: the update the skipped one would have been, at the same lr
    out["moved"] = everywhere(not bit_identical(before, local_state(backend)))
    out["counters"].append((backend.step, backend.updates, backend.nonfinite_in_a_row))

    # an Inf in the gradient of the last rank's last parameter (on every rank that holds a shard or copy
    # of it: replicas' gradients agree after their reduction): two skips are tolerated, the third stops
    weights = dict(backend.local_weights())
    poisoned = everywhere([n for n, t in weights.items() if t.requires_grad and t.numel()][-1])[-1]
    holders = everywhere(poisoned in weights and weights[poisoned].numel() > 0)
    out["poisoned"] = (poisoned, holders.index(True))
    poison_gradients(backend, poisoned)
    before = local_state(backend)
    step(53)
    step(54)
    out["gradient_skips"] = everywhere(bit_identical(before, local_state(backend)))
    out["third"] = stopped(55)
    out["after_stop"] = everywhere(bit_identical(before, local_state(backend)))
    poison_gradients(backend, None)
    out["counters"].append((backend.step, backend.updates, backend.nonfinite_in_a_row))

    step(56)  # finite: the count in a row starts over
    backend.cfg.train.max_nonfinite_steps = 0
    out["at_once"] = stopped(57, nan_advantage=True)

    # checkpoints: marked finite; a non-finite weight (on the last rank) is never written
    if save:
        saved = backend.save_checkpoint(str(checkpoint_dir(root, backend.step)), {})
        out["saved_state"] = torch.load(saved / "trainer_state.pt", weights_only=True)
    tensor = dict(backend.local_weights()).get(poisoned)
    if rank == world - 1 and tensor is not None:
        with torch.no_grad():
            tensor[(0,) * tensor.dim()] = float("nan")
    target = checkpoint_dir(root, backend.step + 1)
    try:
        backend.save_checkpoint(str(target), {})
        out["nonfinite_save"] = None
    except Exception as error:  # noqa: BLE001
        out["nonfinite_save"] = (type(error).__name__, str(error), getattr(error, "phase", None))
    out["unsaved"] = (target.exists(), target.with_name(target.name + ".tmp").exists())
    return out


def check_nonfinite(result: dict, world: int) -> None:
    """What `nonfinite` must find, on either backend (read by the tests, not under torchrun)."""
    m = result["metrics"]
    # 50 finite; 51 NaN advantage: skipped, weights and optimizer state bit for bit as they were
    assert [x["nonfinite_steps"] for x in m] == [0, 1, 0, 1, 1, 0]  # 50, 51, 52, 53, 54, 56
    assert result["advantage_skip"] == [True] * world
    assert m[1]["loss"] != m[1]["loss"]  # NaN (metrics.jsonl writes null)
    # the schedule did not advance: 52 took the update 51 would have, at the same (warmup) lr
    assert m[0]["lr"] == pytest.approx(1e-4) and m[1]["lr"] == m[2]["lr"] == pytest.approx(2e-4)
    assert result["moved"] == [True] * world
    # (train steps done, optimizer steps taken, skipped in a row); a step that stops is not done
    assert result["counters"] == [(2, 1, 1), (3, 2, 0), (5, 2, 3)]
    # an Inf gradient: two skips tolerated, the third stops naming it (and changes nothing either)
    name, rank = result["poisoned"]
    assert result["gradient_skips"] == result["after_stop"] == [True] * world
    third = result["third"]
    assert third["type"] == "NonFiniteError" and (third["step"], third["phase"]) == (6, "train")
    assert third["tensor"].startswith(f"the gradient of {name} (Inf in 1 of ")
    assert third["tensor"].endswith(f", rank {rank})" if world > 1 else ")")
    assert "3 non-finite optimizer steps in a row" in third["message"]
    assert "train.max_nonfinite_steps=2" in third["message"]
    # the limit at 0: the first NaN loss stops, naming the loss
    at_once = result["at_once"]
    stop = [at_once[key] for key in ("type", "step", "phase", "tensor")]
    assert stop == ["NonFiniteError", 7, "train", "loss"]
    # checkpoints are marked finite; a NaN weight (on the last rank) stops the save before anything is written
    if "saved_state" in result:
        assert result["saved_state"]["finite"] is True and result["saved_state"]["step"] == 6
    kind, message, phase = result["nonfinite_save"]
    assert kind == "NonFiniteError" and phase == "checkpoint"
    assert f"weight {name} (NaN in 1 of " in message and "step_00000007 was not written" in message
    if world > 1:
        assert f"rank {world - 1})" in message
    assert result["unsaved"] == (False, False)


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

    # 5. the non-finite guard (shared with tests/train/megatron/backend_scenarios.py)
    backend = FSDPBackend(config(train__max_nonfinite_steps=2, optim__warmup_steps=10), str(model_dir))
    res["nonfinite"] = nonfinite(backend, lambda b: b.shard(rank, world), out / "nonfinite")
    del backend

    # 6. timing (optional): 128 sequences x ~12 tokens
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
