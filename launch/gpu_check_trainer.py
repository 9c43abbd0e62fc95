"""The trainer half of the GPU check (launch/gpu_check.sh): what the megatron backend does only on a GPU.

Run under torchrun with one process: `python -m torch.distributed.run --nproc-per-node 1
launch/gpu_check_trainer.py OUT_DIR [--cpu]`. On the tiny DeepSeek-V4 (transformers' reference model beside
it), each check runs on its own and reports into OUT_DIR/trainer.json:

- `bf16_parity`: the megatron port's token log-probs in fp32 and in bf16 against transformers' fp32 model on
  the same batch (sequences several windows long, the indexer selecting);
- `offload_optimizer`: megatron-core's distributed optimizer with `optimizer_cpu_offload` (precision-aware
  when Transformer Engine imports), two train steps with finite metrics that move the weights;
- `checkpoint_resume`: a distributed-optimizer checkpoint saved after those steps and loaded into a fresh
  backend; one more step from each gives the same weights (Adam's moments came back, not only the weights);
- `nonfinite_skip`: the same optimizer skips a step with a NaN advantage (dsv4rl splits megatron's step into
  `grad_norm` and the update, docs/faults.md): the weights do not move, and the next step lands where it
  would have without the skipped one (Adam's moments, step count and the lr schedule untouched).

`--cpu` runs the same code with gloo on the CPU (megatron's CPU AdamW stands in for the distributed
optimizer there): the plumbing is tested on every machine, the GPU paths only where there is one.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from gpu_check_summary import TRAINER_CHECKS  # beside this file: the checks the summary reads

from dsv4rl.algo.grpo import token_logprobs
from dsv4rl.config.choices import Dtype, TrainBackend
from dsv4rl.config.schema import Config
from dsv4rl.model.model_dir import materialize_model
from dsv4rl.model.native_checkpoint import load_native_model
from dsv4rl.samples import Sample
from dsv4rl.train.backend import build_backend
from dsv4rl.train.batch import TrainBatch
from dsv4rl.train.checkpoint import checkpoint_dir

SEQUENCE = 96  # 12 windows of the tiny model's 8; the CSA indexer keeps 16 of 24 entries at the end
# bf16 rounding moves a token by a few thousandths of a nat; a wrong kernel or layout moves it by far more
PARITY_BOUNDS = {"float32_max_abs_diff": 1e-3, "bfloat16_median_abs_diff": 0.015}


def recipe(**parallel: object) -> Config:
    cfg = Config()
    cfg.parallel.train.backend = TrainBackend.megatron
    cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.eps = 1e-3, 0.1, 1e-4
    cfg.train.micro_batch_size = 2
    for key, value in parallel.items():
        setattr(cfg.parallel.train, key, value)
    return cfg


def batch(vocab: int, seed: int) -> TrainBatch:
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for index in range(4):
        ids = torch.randint(4, vocab, (SEQUENCE,), generator=generator).tolist()
        logprobs = (-1.0 - torch.rand(SEQUENCE - 8, generator=generator)).tolist()
        advantage = float(torch.randn(1, generator=generator))
        samples.append(Sample(index // 2, ids[:8], ids[8:], logprobs, "", "stop", advantage=advantage))
    return TrainBatch.from_samples(samples, pad_id=2)


def weights(backend: object) -> dict[str, torch.Tensor]:
    return {name: tensor.float().cpu() for name, tensor in backend.named_weights_for_sync()}


def bf16_parity(out: Path, device: torch.device) -> dict:
    model_dir = materialize_model(Config().model, str(out / "model"), Config().quant)
    reference = load_native_model(model_dir, dtype=torch.float32).to(device)
    ids = batch(reference.config.vocab_size, seed=1).input_ids.to(device)
    with torch.no_grad():
        expected = token_logprobs(reference(input_ids=ids, use_cache=False).logits, ids).cpu()
    del reference
    result = {}
    for dtype in (Dtype.float32, Dtype.bfloat16):
        cfg = recipe()
        cfg.model.dtype = dtype
        backend = build_backend(cfg, model_dir, device)
        diff = (backend.compute_logprobs(ids).float().cpu() - expected).abs()
        result[dtype.value] = {"mean_abs_diff": diff.mean().item(), "median_abs_diff": diff.median().item(),
                               "max_abs_diff": diff.max().item()}  # fmt: skip
        del backend
    result["bounds"] = PARITY_BOUNDS
    result["ok"] = (
        result["float32"]["max_abs_diff"] < PARITY_BOUNDS["float32_max_abs_diff"]
        and result["bfloat16"]["median_abs_diff"] < PARITY_BOUNDS["bfloat16_median_abs_diff"]
    )
    return result


def offload_recipe(device: torch.device) -> tuple[Config, bool]:
    """The distributed optimizer with CPU offload (precision-aware when Transformer Engine imports)."""
    try:
        import transformer_engine  # noqa: F401

        precision_aware = device.type == "cuda"
    except ImportError:
        precision_aware = False
    cfg = recipe(
        optimizer_cpu_offload=True, optimizer_offload_fraction=0.5, precision_aware_optimizer=precision_aware
    )
    cfg.model.dtype = Dtype.bfloat16 if device.type == "cuda" else Dtype.float32
    return cfg, precision_aware


def offload_and_resume(out: Path, device: torch.device) -> tuple[dict, dict]:
    cfg, precision_aware = offload_recipe(device)
    model_dir = str(out / "model")
    backend = build_backend(cfg, model_dir, device)
    vocab = backend.hf_config.vocab_size
    before = weights(backend)
    metrics = [backend.train_step(batch(vocab, seed=10 + step), temperature=1.0) for step in range(2)]
    moved = max((weights(backend)[name] - tensor).abs().max().item() for name, tensor in before.items())
    finite = all(torch.isfinite(torch.tensor(list(m.values()))).all() for m in metrics)
    offload = {
        "optimizer": type(backend.optimizer).__name__, "precision_aware": precision_aware,
        "loss": [m["loss"] for m in metrics], "grad_norm": [m["grad_norm"] for m in metrics],
        "finite": finite, "max_weight_change": moved, "ok": finite and moved > 0,
    }  # fmt: skip
    saved = backend.save_checkpoint(str(checkpoint_dir(out / "checkpoints", backend.step)), {"cursor": 7})
    backend.train_step(batch(vocab, seed=20), temperature=1.0)
    continued = weights(backend)
    del backend
    fresh = build_backend(cfg, model_dir, device)
    extra = fresh.load_checkpoint(str(saved))
    fresh.train_step(batch(vocab, seed=20), temperature=1.0)
    diff = max((weights(fresh)[name] - tensor).abs().max().item() for name, tensor in continued.items())
    resume = {"checkpoint": str(saved), "extra": extra, "max_abs_diff_after_one_more_step": diff,
              "max_abs_diff_bound": 0.0, "ok": extra == {"cursor": 7} and diff <= 0.0}  # fmt: skip
    return offload, resume


def nonfinite_skip(out: Path, device: torch.device) -> dict:
    cfg, _ = offload_recipe(device)
    ends, result = {}, {}
    for skipping in (False, True):
        backend = build_backend(cfg, str(out / "model"), device)
        vocab = backend.hf_config.vocab_size
        backend.train_step(batch(vocab, seed=30), temperature=1.0)
        before = weights(backend)
        if skipping:
            poisoned = batch(vocab, seed=31)
            poisoned.advantages[0] = float("nan")
            result["nonfinite_steps"] = backend.train_step(poisoned, temperature=1.0)["nonfinite_steps"]
            result["unchanged"] = all(torch.equal(before[n], t) for n, t in weights(backend).items())
        backend.train_step(batch(vocab, seed=32), temperature=1.0)
        ends[skipping] = weights(backend)
        if not skipping:
            result["step_size"] = max((ends[False][n] - t).abs().max().item() for n, t in before.items())
        del backend
    result["max_abs_diff_to_unskipped"] = max(
        (ends[True][n] - t).abs().max().item() for n, t in ends[False].items()
    )
    # exact on the CPU; a GPU's reductions may round differently from one run to the next, never by a step
    result["max_abs_diff_to_unskipped_bound"] = 0.01 * result["step_size"]
    result["ok"] = (
        result["nonfinite_steps"] == 1
        and result["unchanged"]
        and result["max_abs_diff_to_unskipped"] <= result["max_abs_diff_to_unskipped_bound"]
    )
    return result


def timed(check: Callable[[], object]) -> tuple[object, float, str | None]:
    start = time.monotonic()
    try:
        return check(), time.monotonic() - start, None
    except Exception:
        return None, time.monotonic() - start, traceback.format_exc(limit=8)


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    on_gpu = torch.cuda.is_available() and "--cpu" not in sys.argv
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if on_gpu else "gloo")
    report: dict = {"device": torch.cuda.get_device_name(0) if on_gpu else "cpu", "torch": torch.__version__}
    parity, seconds, error = timed(lambda: bf16_parity(out, device))
    report["bf16_parity"] = parity or {"ok": False, "error": error}
    report["bf16_parity"]["seconds"] = seconds
    pair, seconds, error = timed(lambda: offload_and_resume(out, device))
    offload, resume = pair if pair is not None else ({"ok": False, "error": error}, {"ok": False})
    report["offload_optimizer"], report["checkpoint_resume"] = offload, resume
    report["offload_optimizer"]["seconds"] = seconds
    skip, seconds, error = timed(lambda: nonfinite_skip(out, device))
    report["nonfinite_skip"] = skip or {"ok": False, "error": error}
    report["nonfinite_skip"]["seconds"] = seconds
    report["ok"] = all(report[k]["ok"] for k in TRAINER_CHECKS)
    (out / "trainer.json").write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps(report, default=str))
    dist.destroy_process_group()
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
