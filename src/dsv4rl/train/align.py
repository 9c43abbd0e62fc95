"""`dsv4rl align`: how far the engine's log-probs are from the trainer's, on the engine's own samples.

The worker runs this instead of the RL loop (`--task align`): it pushes the trainer's weights to the
engines through the real weight sync (quantized on send as the recipe says), lets the engines sample
responses, recomputes the log-prob of every sampled token with the trainer on exactly the same tokens,
and writes the distribution of |trainer - engine| to `<run dir>/align.json` (rank 0). This is the
train-vs-rollout mismatch a GRPO step sees right after a sync; TIS/MIS correct for it.

After the push `sync.verify.checksum` is checked as in training. `sync.verify.logprob_probe` is not run:
the report is the same measurement (trainer against engine log-probs of the same tokens, after the push)
on the tokens the engine sampled, with its mean and max; `launch/gpu_check.sh` bounds those.
"""

from __future__ import annotations

import json
import logging
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dsv4rl.algo.mismatch import abs_diff_summary
from dsv4rl.config.schema import Config, SamplingConfig
from dsv4rl.data.datasets import problem_source
from dsv4rl.data.stream import PromptStream
from dsv4rl.rollout.generate import generate_samples, rollout_seed
from dsv4rl.samples import Sample
from dsv4rl.sync.stages import StagedWeightSync
from dsv4rl.sync.weight_sync import SyncStats
from dsv4rl.train.backend import TrainerBackend
from dsv4rl.train.batch import TrainBatch
from dsv4rl.train.driver import Driver

log = logging.getLogger("dsv4rl.align")
REPORT_FILE = "align.json"


def align_sampling(cfg: Config) -> SamplingConfig:
    """The rollout's sampling, with `align.max_new_tokens` when set."""
    if cfg.align.max_new_tokens is None:
        return cfg.algo.sampling
    return replace(cfg.algo.sampling, max_new_tokens=cfg.align.max_new_tokens)


def align_samples(cfg: Config, driver: Driver) -> list[Sample]:
    """What the engines sample for the align prompts (`align.prompts` x `align.samples_per_prompt`)."""
    problems = PromptStream(
        problem_source(cfg.data, cfg.seed), cfg.align.prompts, seed=cfg.seed, shuffle=cfg.data.shuffle
    ).next_batch()
    return driver.event_loop.run_until_complete(
        generate_samples(
            driver.clients,
            problems,
            driver.tokenizer,
            cfg.align.samples_per_prompt,
            align_sampling(cfg),
            seed=rollout_seed(cfg.seed, 0) if cfg.engine.reproducible_sampling else None,
            renderer=driver.renderer,
        )
    )


def worst_tokens(
    batch: TrainBatch, trainer: torch.Tensor, tokenizer: Any, count: int, context_tokens: int = 24
) -> list[dict[str, Any]]:
    """The `count` response tokens with the largest |trainer - rollout|, with the text before them."""
    diff = (trainer.float() - batch.rollout_logprobs.float()).abs() * batch.loss_mask
    flat = diff.flatten()
    picked = torch.topk(flat, min(count, int(batch.loss_mask.sum()))).indices.tolist()
    width = diff.shape[1]
    out = []
    for index in picked:
        row, position = divmod(index, width)
        ids = batch.input_ids[row].tolist()
        target = ids[position + 1]
        start = max(0, position + 1 - context_tokens)
        out.append(
            {
                "abs_diff": float(flat[index]),
                "trainer_logprob": float(trainer[row, position]),
                "rollout_logprob": float(batch.rollout_logprobs[row, position]),
                "sequence": row,
                "position": position + 1,
                "token_id": target,
                "token": tokenizer.decode([target]),
                "context": tokenizer.decode(ids[start : position + 1]),
            }
        )
    return out


def align_report(
    cfg: Config,
    batch: TrainBatch,
    trainer: torch.Tensor,
    stats: SyncStats,
    engines: list[str],
    tokenizer: Any,
) -> dict[str, Any]:
    """The report of one align run: |trainer - engine| over the response tokens of `batch` (the engine's
    log-probs are its `rollout_logprobs`), the settings that shaped it and the push it followed."""
    sampling = align_sampling(cfg)
    return {
        "quant": cfg.quant.name.value,
        # how the engine rounds (reference engine: exact or SGLang's emulated points) and the trainer does
        "numerics": {
            "engine": cfg.engine.numerics.value,
            "engine_features": None
            if cfg.engine.numerics_features is None
            else [str(f) for f in cfg.engine.numerics_features],
            "fp32_lm_head": cfg.engine.fp32_lm_head,
            **{f"train_{f.name}": getattr(cfg.train.numerics, f.name) for f in fields(cfg.train.numerics)},
        },
        **abs_diff_summary(trainer, batch.rollout_logprobs, batch.loss_mask),
        "responses": batch.size,
        "prompts": cfg.align.prompts,
        "samples_per_prompt": cfg.align.samples_per_prompt,
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "engines": engines,
        "sync": {
            "bytes": stats.bytes,
            "seconds": stats.seconds,
            "buckets": stats.buckets,
            "tensors": stats.tensors,
            "transport": stats.transport.value,  # broadcast (a process group) or tensor (colocated handles)
        },
        "worst_tokens": worst_tokens(batch, trainer, tokenizer, cfg.align.worst_tokens),
    }


def write_report(run_dir: Path, report: dict[str, Any]) -> Path:
    """`<run_dir>/align.json`, replaced whole: a reader never sees half a report."""
    path = run_dir / REPORT_FILE
    partial = path.with_name(f".{REPORT_FILE}.tmp")
    partial.write_text(json.dumps(report, indent=2) + "\n")
    partial.replace(path)
    return path


def run_align(
    cfg: Config, backend: TrainerBackend, driver: Driver | None, weight_sync: StagedWeightSync, run_dir: Path
) -> dict | None:
    """Collective (every rank recomputes the log-probs); rank 0 returns and writes the report."""
    named = backend.named_weights_for_sync(by_stage=weight_sync.by_stage)
    stats = weight_sync.push(named, version="align", record_checksums=cfg.sync.verify.checksum)
    if driver is not None and cfg.sync.verify.checksum:
        driver.verifier.check_checksums(stats.checksums, 0)
    sampling = align_sampling(cfg)
    box: list[Any] = [None]
    if driver is not None:
        box[0] = TrainBatch.from_samples(align_samples(cfg, driver), pad_id=driver.tokenizer.pad_token_id)
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    batch: TrainBatch = box[0]
    trainer = backend.compute_logprobs(batch.input_ids, temperature=sampling.temperature).float().cpu()
    if driver is None:
        return None
    engines = [client.base_url for client in driver.clients]
    report = align_report(cfg, batch, trainer, stats, engines, driver.tokenizer)
    write_report(run_dir, report)
    log.info(
        "align (quant=%s): mean |trainer - engine| log-prob %.3g over %d tokens (p99 %.3g, max %.3g)",
        *(report["quant"], report["mean_abs_diff"], report["tokens"], report["p99_abs_diff"]),
        report["max_abs_diff"],
    )
    return report
