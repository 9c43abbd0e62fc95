"""Checks after a weight sync: did every engine get exactly what the trainer sent?

Two checks, each stopping the run with the step and the evidence when it fails:
- **checksums** (engines that can recompute the trainer's digests: the reference engine): the sha256 of
  every tensor as it left the trainer's pipeline against the engine's `/weights_checker` digests of what
  it holds, by native name. Catches any corrupted byte, a tensor the sync never sent (a stale tid2eid),
  and one the engine does not hold. SGLang's digests cover its internal, dequantized tensors under fused
  names, so they can never match; there only the probe applies.
- **log-prob probe** (any engine): a fixed set of token sequences is scored by the engine (`/generate` with
  `max_new_tokens: 0`, `return_logprob`, `logprob_start_len: 0`; SGLang answers `input_token_logprobs`
  [[null, id, null], [lp, id, null], ...], unscaled by temperature) and by the trainer; the run stops when
  the mean |difference| exceeds the quant mode's bound. Quantizing the weights moves the engine's
  log-probs by a little; a corrupted bucket moves them by a lot (or to NaN, which also stops the run).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dsv4rl.aio import run_on
from dsv4rl.config.choices import EngineNumerics, QuantMode
from dsv4rl.config.schema import SyncVerifyConfig
from dsv4rl.sync.errors import WeightSyncError, engine_name
from dsv4rl.wire.engine_api import EngineAPI

__all__ = [
    "PROBE_BOUNDS",
    "SyncVerificationError",
    "SyncVerifier",
    "checksum_problems",
    "engine_input_logprobs",
    "probe_sequences",
]

# Mean |trainer - engine| log-prob over the probe's tokens above which a sync is declared broken. The
# probe's uniformly random tokens are improbable, so quantization moves their log-probs more than it moves
# sampled tokens', and more as training sharpens the model: over a 120-step `tiny_arith quant=fp8_mxfp4`
# run an honest sync measured 0.008 at the start and at most 0.14; a corrupted bucket measures > 1e20
# (tests/sync/test_verify.py). The bounds leave about 7x room over the honest FP8 value; override with
# sync.verify.max_mean_abs_diff (calibrate a large model with `dsv4rl align`).
PROBE_BOUNDS: dict[QuantMode, float] = {
    QuantMode.none: 1e-3,
    QuantMode.bf16: 0.1,
    QuantMode.fp8_rollout: 1.0,
    QuantMode.fp8_mxfp4: 1.0,
}
# An engine computing with SGLang's rounding points (`engine.numerics=sglang`: bf16 weights and activations,
# an FP8 KV cache) moves the log-probs as an FP8 checkpoint does, whatever the quant mode.
SGLANG_NUMERICS_BOUND = PROBE_BOUNDS[QuantMode.fp8_rollout]
PROBE_SEED = 20260601  # the probe's sequences are the same in every run


class SyncVerificationError(WeightSyncError):
    """A sync delivered something other than what was sent: the message names the step and the evidence."""


def probe_sequences(vocab_size: int, count: int, length: int, bos: int | None = None) -> torch.Tensor:
    """[count, length] token ids drawn uniformly from the vocabulary (BOS first when the model has one)."""
    generator = torch.Generator().manual_seed(PROBE_SEED)
    ids = torch.randint(0, vocab_size, (count, length), generator=generator)
    if bos is not None:
        ids[:, 0] = bos
    return ids


def checksum_problems(sent: Mapping[str, str], held: Mapping[str, str]) -> list[str]:
    """What differs between the digests of what was sent and what an engine holds (empty: identical)."""
    changed = sorted(name for name in sent if name in held and held[name] != sent[name])
    unknown = sorted(name for name in sent if name not in held)
    stale = sorted(name for name in held if name not in sent)
    problems = []
    if changed:
        problems.append(f"{len(changed)} tensors differ from what was sent: {changed[:8]}")
    if unknown:
        problems.append(f"{len(unknown)} tensors sent are not held by the engine: {unknown[:8]}")
    if stale:
        problems.append(f"{len(stale)} tensors the engine holds were never sent (left stale): {stale[:8]}")
    return problems


def engine_input_logprobs(outputs: Sequence[dict], length: int) -> torch.Tensor:
    """[B, length-1] from `/generate` answers with `logprob_start_len: 0` (the first entry is null)."""
    rows = []
    for output in outputs:
        entries = output["meta_info"]["input_token_logprobs"]
        if len(entries) != length or entries[0][0] is not None:
            raise SyncVerificationError(
                f"the engine returned {len(entries)} input log-probs for a {length}-token probe sequence "
                "(expected one per token, the first null)"
            )
        rows.append([math.nan if entry[0] is None else float(entry[0]) for entry in entries[1:]])
    return torch.tensor(rows, dtype=torch.float32)


class SyncVerifier:
    """Runs the configured checks after a sync against `clients` (rank 0 only)."""

    def __init__(
        self,
        clients: Sequence[EngineAPI],
        cfg: SyncVerifyConfig,
        quant: QuantMode,
        event_loop: asyncio.AbstractEventLoop,
        engine_numerics: EngineNumerics = EngineNumerics.exact,
    ) -> None:
        self.clients = list(clients)
        self.cfg = cfg
        self.quant = QuantMode(quant)
        bound = PROBE_BOUNDS[self.quant]
        if engine_numerics == EngineNumerics.sglang:
            bound = max(bound, SGLANG_NUMERICS_BOUND)
        self.bound = cfg.max_mean_abs_diff if cfg.max_mean_abs_diff is not None else bound
        self.event_loop = event_loop

    def check_checksums(self, sent: Mapping[str, str], step: int) -> dict[str, float]:
        """Compare what was sent with every engine's digests; raise naming the tensors that differ."""

        async def fetch() -> list[Any]:
            return await asyncio.gather(*(c.weights_checker("checksum") for c in self.clients))

        failures = []
        for client, body in zip(self.clients, run_on(self.event_loop, fetch()), strict=True):
            held: dict[str, str] = {}
            for rank in body.get("ranks") or []:
                held.update(rank.get("checksums") or {})
            problems = checksum_problems(sent, held)
            if problems:
                failures.append(f"engine {engine_name(client)}: " + "; ".join(problems))
        if failures:
            raise SyncVerificationError(
                f"weight sync of step {step} failed verification by checksum: " + " | ".join(failures)
            )
        return {"verify_checksum_tensors": float(len(sent))}

    def check_probe(self, probe: torch.Tensor, trainer_logprobs: torch.Tensor, step: int) -> dict[str, float]:
        """Score `probe` on every engine and compare with the trainer's log-probs; raise above the bound."""
        ids = probe.tolist()
        params = {"max_new_tokens": 0, "temperature": 1.0}

        async def score() -> list[Any]:
            return await asyncio.gather(
                *(c.generate(ids, params, return_logprob=True, logprob_start_len=0) for c in self.clients)
            )

        trainer = trainer_logprobs.detach().float().cpu()
        worst = 0.0
        failures = []
        for client, outputs in zip(self.clients, run_on(self.event_loop, score()), strict=True):
            engine = engine_input_logprobs(outputs, probe.shape[1])
            diff = (engine - trainer).abs()
            mean = float(diff.mean())
            if not mean <= self.bound:  # NaN fails too
                failures.append(
                    f"engine {engine_name(client)}: mean |trainer - engine| log-prob {mean:.4g}, max "
                    f"{float(diff.max()):.4g} over {diff.numel()} probe tokens"
                )
            worst = max(worst, mean)
        if failures:
            raise SyncVerificationError(
                f"weight sync of step {step} failed the log-prob probe (bound {self.bound:g} for "
                f"quant={self.quant.value}; sync.verify.max_mean_abs_diff overrides it): "
                + "; ".join(failures)
            )
        return {"verify_probe_abs_diff": worst}
