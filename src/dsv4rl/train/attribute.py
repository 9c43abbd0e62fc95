"""`dsv4rl align --attribute`, the trainer side: one engine start's share of the attribution grid.

The CLI runs the align task once per engine start the grid needs (`dsv4rl.algo.attribution`: only
`engine.fp32_lm_head` changes the engine). The first run samples the responses and keeps them in
`<run dir>/attribute_sequences.json`; every run then has its engine score exactly those token sequences
(`/generate` with `max_new_tokens: 0`, `return_logprob`, `logprob_start_len: 0`, and the engine's routed
experts and indexer top-k of every position, `routed_experts_start_len: 0`), and the trainer recomputes
them once per configuration, switching its own features between forwards: the replays (the engine's
choices from that same scoring) and the straight-through rounding of `train.numerics.*`. So every row of
the report scores the same tokens, and one engine start serves every trainer-side configuration.

Scores are at temperature 1: SGLang's input log-probs are not scaled by the sampling temperature.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dsv4rl.algo.attribution import (
    SEQUENCES_FILE,
    TRAINER_ROUNDING,
    Configuration,
    configuration_grid,
    configuration_name,
    current_engine_flags,
    engine_groups,
    engine_report_file,
)
from dsv4rl.algo.mismatch import abs_diff_summary
from dsv4rl.config.choices import AlignFeature, NumericsFeature
from dsv4rl.config.schema import Config
from dsv4rl.model.sglang_numerics import apply_trainer_numerics
from dsv4rl.rollout.choices import ChoiceRequest, attach_choices
from dsv4rl.samples import Sample
from dsv4rl.sync.stages import StagedWeightSync
from dsv4rl.train.align import align_samples, worst_tokens
from dsv4rl.train.backend import TrainerBackend
from dsv4rl.train.batch import TrainBatch
from dsv4rl.train.driver import Driver

log = logging.getLogger("dsv4rl.align")


# ------------------------------------------------------------------------------------- sequences
def save_sequences(path: Path, sequences: Sequence[tuple[list[int], list[int]]]) -> None:
    rows = [{"prompt_ids": list(p), "response_ids": list(r)} for p, r in sequences]
    partial = path.with_name(f".{path.name}.tmp")
    partial.write_text(json.dumps({"sequences": rows}) + "\n")
    partial.replace(path)


def load_sequences(path: Path) -> list[tuple[list[int], list[int]]]:
    rows = json.loads(path.read_text())["sequences"]
    return [(list(row["prompt_ids"]), list(row["response_ids"])) for row in rows]


def fixed_sequences(
    path: Path, sample: Callable[[], list[tuple[list[int], list[int]]]]
) -> list[tuple[list[int], list[int]]]:
    """The sequences every engine start scores: sampled (`sample()`) and kept at `path` by the first one,
    read back by the others."""
    if not path.is_file():
        save_sequences(path, sample())
    return load_sequences(path)


def sample_sequences(cfg: Config, driver: Driver) -> list[tuple[list[int], list[int]]]:
    """The responses the engines sample for the align prompts, as (prompt ids, response ids)."""
    samples = align_samples(cfg, driver)
    return [(s.prompt_ids, s.response_ids) for s in samples if s.response_ids]


def scored_sample(prompt: list[int], response: list[int], answer: dict, asked: ChoiceRequest) -> Sample:
    """A sample whose `rollout_logprobs` are the engine's input log-probs of the response tokens (entry k
    is log p(token k | tokens < k); entry 0 is null) and whose choices cover every forwarded position."""
    meta = answer["meta_info"]
    entries = meta["input_token_logprobs"]
    length = len(prompt) + len(response)
    if len(entries) != length:
        raise ValueError(
            f"the engine returned {len(entries)} input log-probs for a {length}-token sequence (expected one "
            "per token with logprob_start_len=0)"
        )
    logprobs = [float(entry[0]) for entry in entries[len(prompt) :]]
    sample = Sample(0, prompt, response, logprobs, "", "stop")
    return attach_choices(sample, meta, asked)


async def _score(clients: Sequence[Any], sequences, asked: ChoiceRequest) -> list[dict]:  # noqa: ANN001
    params = {"max_new_tokens": 0, "temperature": 1.0}
    calls = [
        clients[i % len(clients)].generate(
            prompt + response, params, return_logprob=True, logprob_start_len=0, **asked.generate_kwargs()
        )
        for i, (prompt, response) in enumerate(sequences)
    ]
    return list(await asyncio.gather(*calls))


def engine_scored_batch(driver: Driver, sequences, features: Sequence[AlignFeature]) -> TrainBatch:  # noqa: ANN001
    """The fixed sequences as the engine scores them: log-probs and, for the replays, its choices."""
    asked = ChoiceRequest(
        routed_experts=AlignFeature.routing_replay in features,
        indexer_topk=AlignFeature.indexer_replay in features,
    )
    answers = driver.event_loop.run_until_complete(_score(driver.clients, sequences, asked))
    samples = [scored_sample(p, r, a, asked) for (p, r), a in zip(sequences, answers, strict=True)]
    return TrainBatch.from_samples(samples, pad_id=driver.tokenizer.pad_token_id)


# ------------------------------------------------------------------------------------- trainer
@contextmanager
def trainer_features(backend: TrainerBackend, cfg: Config, configuration: Configuration) -> Iterator[None]:
    """The backend's forwards with the trainer-side features of `configuration`: the replays through its
    algo config, the fake quantization installed on its transformers model (fsdp)."""
    algo = replace(
        cfg.algo,
        routing_replay=AlignFeature.routing_replay in configuration,
        indexer_replay=AlignFeature.indexer_replay in configuration,
    )
    saved = backend.cfg
    backend.cfg = replace(cfg, algo=algo)
    numerics = [NumericsFeature(f.value) for f in AlignFeature if f in TRAINER_ROUNDING & configuration]
    installed = None
    try:
        if numerics:
            model = getattr(backend, "model", None)
            if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
                raise RuntimeError("train.numerics.* features need the fsdp backend's transformers model")
            installed = apply_trainer_numerics(model, numerics, cfg.quant.name)
        yield
    finally:
        if installed is not None:
            installed.remove()
        backend.cfg = saved


def trainer_logprobs(backend: TrainerBackend, batch: TrainBatch) -> torch.Tensor:
    """[B, T-1] log-probs of the whole batch at temperature 1, through the backend's micro-batches (the
    replays read each micro-batch's choices); columns past a micro-batch's trimmed width stay 0 (no loss)."""
    micro = backend.micro_batches(batch, 0)
    parts = backend.forward_logprobs(micro, 1.0)
    out = torch.zeros(batch.input_ids.shape[0], batch.input_ids.shape[1] - 1)
    for part, values in zip(micro, parts, strict=True):
        values = values.float().cpu()[: part.real]
        out[part.row : part.row + part.real, : values.shape[1]] = values
    return out


# ------------------------------------------------------------------------------------- the task
def run_attribution(
    cfg: Config, backend: TrainerBackend, driver: Driver | None, weight_sync: StagedWeightSync, run_dir: Path
) -> dict | None:
    """Collective: push the weights, score the fixed sequences on this run's engines, recompute them per
    trainer-side configuration; rank 0 writes and returns this engine start's summaries."""
    features = list(cfg.align.attribute or [])
    named = backend.named_weights_for_sync(by_stage=weight_sync.by_stage)
    stats = weight_sync.push(named, version="align", record_checksums=cfg.sync.verify.checksum)
    if driver is not None and cfg.sync.verify.checksum:
        driver.verifier.check_checksums(stats.checksums, 0)
    flags = current_engine_flags(cfg)
    configurations = engine_groups(configuration_grid(features)).get(flags, [])
    box: list[Any] = [None]
    if driver is not None:
        sequences = fixed_sequences(run_dir / SEQUENCES_FILE, lambda: sample_sequences(cfg, driver))
        box[0] = engine_scored_batch(driver, sequences, features)
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    batch: TrainBatch = box[0]
    results = {}
    for configuration in configurations:
        with trainer_features(backend, cfg, configuration):
            trainer = trainer_logprobs(backend, batch)
        if driver is not None:
            summary = abs_diff_summary(trainer, batch.rollout_logprobs, batch.loss_mask)
            summary["worst_tokens"] = worst_tokens(batch, trainer, driver.tokenizer, cfg.align.worst_tokens)
            results[configuration_name(configuration)] = summary
            log.info(
                "attribute [%s] engine %s: mean |trainer - engine| %.3g (p99 %.3g, max %.3g)",
                configuration_name(configuration),
                configuration_name(flags),
                summary["mean_abs_diff"],
                summary["p99_abs_diff"],
                summary["max_abs_diff"],
            )
    if driver is None:
        return None
    report = {
        "engine_flags": configuration_name(flags),
        "sequences": batch.size,
        "configurations": results,
        "engines": [client.base_url for client in driver.clients],
        "sync": {"bytes": stats.bytes, "seconds": stats.seconds},
    }
    path = run_dir / engine_report_file(flags)
    partial = path.with_name(f".{path.name}.tmp")
    partial.write_text(json.dumps(report, indent=2) + "\n")
    partial.replace(path)
    return report
