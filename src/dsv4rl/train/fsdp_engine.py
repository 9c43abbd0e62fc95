"""The `fsdp` train engine: PyTorch FSDP2 (`fully_shard`) over a transformers DeepseekV4ForCausalLM.

One instance per training rank, inside an initialised default process group (torchrun). The same
code runs with gloo on CPU and nccl/rccl on GPUs. Every public method is collective: all ranks call
it, with the same number of sequences in `train_step` (shard the global batch with TrainBatch.shard).

With one rank there is nothing to shard, and the model stays a plain module: FSDP2's per-layer hooks,
parameter copies and DTensor dispatch cost a tiny model's step about 10 % (`sharded` says which).
Checkpoints are the same either way: distributed checkpointing stores whole tensors by their global
offsets, so a run saved at one world size resumes at another.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from dsv4rl.algo.grpo import token_logprobs
from dsv4rl.algo.loss import (
    CLIPPED,
    ENTROPY,
    KL,
    LOSS,
    from_training_forward,
    gradient_scale,
    micro_batch_loss,
    normaliser_share,
    old_policy,
    step_metrics,
)
from dsv4rl.config.schema import Config
from dsv4rl.model.native_checkpoint import load_native_model
from dsv4rl.train import checkpoint as ckpt
from dsv4rl.train.batch import TrainBatch


def default_device() -> torch.device:
    """cuda:LOCAL_RANK when CUDA is available, else cpu."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def full_tensor(tensor: Tensor) -> Tensor:
    """The whole of a (possibly sharded) parameter."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


class LearningRateSchedule:
    """Multiplier of the base lr: linear warmup over `warmup` optimizer steps (step k uses (k+1)/warmup),
    then constant, or a cosine decay to `min_ratio` at step `total` - 1."""

    def __init__(self, warmup: int, total: int = 0, kind: str = "constant", min_ratio: float = 0.1) -> None:
        if kind not in ("constant", "cosine"):
            raise ValueError(f"optim.lr_schedule={kind!r}: choose constant or cosine")
        self.warmup, self.total, self.kind, self.min_ratio = warmup, total, kind, min_ratio

    def __call__(self, step: int) -> float:
        if self.warmup > 0 and step < self.warmup:
            return (step + 1) / self.warmup
        if self.kind == "constant" or self.total <= self.warmup + 1:
            return 1.0
        progress = min(1.0, (step - self.warmup) / (self.total - 1 - self.warmup))
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class FSDPTrainEngine:
    def __init__(self, cfg: Config, model_path: str, device: torch.device | None = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "FSDPTrainEngine needs an initialised default process group: run under torchrun and call "
                "torch.distributed.init_process_group (gloo on CPU, nccl on GPU) first"
            )
        self.cfg = cfg
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.device = device if device is not None else default_device()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.sharded = self.world > 1  # one rank: a plain module (see the module docstring)
        self.mesh = init_device_mesh(self.device.type, (self.world,)) if self.sharded else None
        self.data_parallel_rank, self.data_parallel_size = self.rank, self.world  # FSDP shards data only
        self.model = self._load(model_path, trainable=True)
        self.hf_config = self.model.config
        self.ref_model = self._load(model_path, trainable=False) if cfg.algo.kl_coef > 0 else None
        optim = cfg.optim
        if optim.name.lower() != "adamw":
            raise ValueError(f"optim.name={optim.name!r}: the fsdp engine supports only 'adamw'")
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=optim.lr,
            betas=(float(optim.betas[0]), float(optim.betas[1])),
            eps=optim.eps,
            weight_decay=optim.weight_decay,
            fused=True,  # one kernel for all parameters: 0.008 s a tiny-model step, 0.09 s tensor by tensor
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            LearningRateSchedule(
                optim.warmup_steps,
                total=cfg.train.steps * cfg.algo.updates_per_step,
                kind=optim.lr_schedule,
                min_ratio=optim.min_lr_ratio,
            ),
        )
        self.step = 0  # completed train_step calls
        # False forces the separate old-policy forward even when the training forward could serve (tests)
        self.reuse_policy_forward = True

    # ------------------------------------------------------------------ model
    def _load(self, model_path: str, trainable: bool) -> torch.nn.Module:
        # A native checkpoint in any quant format, dequantized to the training dtype (float32).
        model = load_native_model(model_path, dtype=torch.float32)
        model.to(self.device)
        # eval(): no dropout, so the trainer's logprobs match the rollout engine's and each other
        model.eval()
        model.requires_grad_(trainable)
        if self.sharded:
            for layer in model.model.layers:
                fully_shard(layer, mesh=self.mesh)
            fully_shard(model, mesh=self.mesh)
        return model

    def _reshard(self, model: torch.nn.Module) -> None:
        """FSDP2 keeps the root's parameters unsharded after a forward without backward."""
        if self.sharded:
            model.reshard()

    def _micro_logprobs(
        self, model: torch.nn.Module, input_ids: Tensor, temperature: float
    ) -> tuple[Tensor, Tensor]:
        logits = model(input_ids=input_ids, use_cache=False).logits
        return token_logprobs(logits, input_ids, temperature), logits

    def _sync_count(self, n: int) -> int:
        """The largest `n` over ranks: every rank must run the same number of forwards (FSDP collectives)."""
        t = torch.tensor([n], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    @torch.no_grad()
    def _forward_logprobs(self, model: torch.nn.Module, input_ids: Tensor, temperature: float) -> Tensor:
        input_ids = input_ids.to(self.device)
        size = self.cfg.train.micro_batch_size
        chunks = list(input_ids.split(size)) if input_ids.shape[0] else []
        steps = self._sync_count(len(chunks))  # before any forward: collectives must pair up
        out = [self._micro_logprobs(model, chunk, temperature)[0] for chunk in chunks]
        dummy = torch.zeros(1, 2, dtype=torch.long, device=self.device)
        for _ in range(steps - len(chunks)):
            self._micro_logprobs(model, dummy, temperature)  # keep step with ranks that have more
        self._reshard(model)
        if not out:
            return torch.zeros(0, max(input_ids.shape[1] - 1, 0), device=self.device)
        return torch.cat(out)

    def compute_logprobs(self, input_ids: Tensor, temperature: float = 1.0) -> Tensor:
        """log p(input_ids[:, t+1] | input_ids[:, :t+1]) of this rank's sequences, [B, T-1], no grad."""
        return self._forward_logprobs(self.model, input_ids, temperature)

    def compute_ref_logprobs(self, input_ids: Tensor, temperature: float = 1.0) -> Tensor:
        if self.ref_model is None:
            raise RuntimeError("no reference model: it is loaded only when algo.kl_coef > 0")
        return self._forward_logprobs(self.ref_model, input_ids, temperature)

    @torch.no_grad()
    def _masked_logprobs(self, model: torch.nn.Module, batch: TrainBatch, temperature: float) -> Tensor:
        """Logprobs over the loss-bearing targets, computed on the same trimmed micro-batches the
        update uses (so ratio == 1 exactly on the first update); zero past each micro-batch's trim."""
        out = torch.zeros_like(batch.loss_mask)
        row = 0
        for mini in batch.split(self.cfg.algo.updates_per_step):
            for micro in mini.micro_batches(self.cfg.train.micro_batch_size):
                lp = self._micro_logprobs(model, micro.trimmed().input_ids, temperature)[0]
                out[row : row + micro.size, : lp.shape[1]] = lp
                row += micro.size
        self._reshard(model)
        return out

    # ------------------------------------------------------------------ training
    def train_step(self, batch: TrainBatch, temperature: float | None = None) -> dict[str, float]:
        """One rollout batch (this rank's shard): algo.updates_per_step optimizer steps.

        Loss aggregation is over the global mini-batch: per-micro-batch sums are divided by the
        denominator all-reduced over ranks, and multiplied by the world size because FSDP averages
        gradients over ranks. So the update does not depend on the world size or micro-batch size. The
        loss itself is `dsv4rl.algo.loss.micro_batch_loss`; this engine only runs forward and backward.
        """
        algo, cfg = self.cfg.algo, self.cfg
        temp = algo.sampling.temperature if temperature is None else temperature
        mode = str(getattr(algo.loss_aggregation, "value", algo.loss_aggregation))
        updates = algo.updates_per_step
        batch = batch.to(self.device)
        sizes = torch.tensor([batch.size, -batch.size], device=self.device)
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX)
        if int(sizes[0]) != -int(sizes[1]):
            raise ValueError(
                f"ranks hold different batch sizes ({-int(sizes[1])}..{int(sizes[0])}); use TrainBatch.shard"
            )
        if batch.size % updates:
            raise ValueError(
                f"{batch.size} sequences per rank do not split into algo.updates_per_step={updates}"
            )

        self.model.eval()
        ref = batch.ref_logprobs
        if self.ref_model is not None and ref is None:
            ref = self._masked_logprobs(self.ref_model, batch, temp)
        policy = old_policy(
            algo,
            batch.old_logprobs,
            batch.rollout_logprobs,
            batch.loss_mask,
            ref is not None,
            lambda: self._masked_logprobs(self.model, batch, temp),
            reuse_allowed=self.reuse_policy_forward,
        )
        stats = policy.sums
        grad_norms, lrs = [], []
        row = 0
        for mini in batch.split(updates):
            share = normaliser_share(mini.loss_mask, mode, algo.sampling.max_new_tokens).to(torch.float64)
            dist.all_reduce(share)
            denom = max(float(share), 1.0)  # no response token anywhere: loss 0, like aggregate
            scale = gradient_scale(denom, self.world)
            self.optimizer.zero_grad(set_to_none=True)
            for micro in mini.micro_batches(cfg.train.micro_batch_size):
                m = micro.trimmed()
                n = m.loss_mask.shape[1]
                rows = slice(row, row + micro.size)
                row += micro.size
                logp, logits = self._micro_logprobs(self.model, m.input_ids, temp)
                if policy.reuse:
                    micro_old, micro_tis, sums = from_training_forward(
                        algo, logp, m.rollout_logprobs, m.loss_mask, ref is not None
                    )
                    stats += sums
                else:
                    micro_old = policy.logprobs[rows, :n]
                    micro_tis = None if policy.tis_weights is None else policy.tis_weights[rows, :n]
                out = micro_batch_loss(
                    logp,
                    logits,
                    micro_old,
                    m.advantages,
                    m.loss_mask,
                    algo,
                    temp,
                    ref_logprobs=None if ref is None else ref[rows, :n],
                    tis_weights=micro_tis,
                )
                (out.loss_sum * scale).backward()
                stats[LOSS] += out.loss_sum.detach() / denom
                stats[ENTROPY] += out.entropy_sum
                stats[CLIPPED] += out.clipped_tokens
                if out.ref_kl_sum is not None:
                    stats[KL] += out.ref_kl_sum
            grad_norms.append(self._clip_gradients())
            lrs.append(self.scheduler.get_last_lr()[0])
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        dist.all_reduce(stats)
        return step_metrics(stats, updates, grad_norms, lrs, ref is not None)

    def _clip_gradients(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return float(norm)

    # ------------------------------------------------------------------ weights and checkpoints
    weight_source_ranks = (0,)  # one stage, sent by rank 0

    @torch.no_grad()
    def named_weights_for_sync(self, by_stage: bool = False) -> Iterator[tuple[str, Tensor]]:
        """Full tensors of every parameter and persistent buffer, HF names, on rank 0.

        Collective: every rank must exhaust the iterator (each sharded tensor is all-gathered);
        only rank 0 yields (`by_stage` changes nothing: the model is one stage, sent by rank 0).
        Tensors stay on the training device (what a NCCL broadcast needs) and keep their dtype (tid2eid
        stays int64). Non-persistent buffers (rotary inv_freq) are not sent.
        """
        for name, tensor in self.model.state_dict().items():
            full = full_tensor(tensor)
            if self.rank == 0:
                yield name, full.detach()

    def save_checkpoint(self, directory: str, extra_state: dict[str, Any]) -> Path:
        return ckpt.save_checkpoint(
            directory,
            self.model,
            self.optimizer,
            self.scheduler,
            self.step,
            extra_state,
            keep=self.cfg.train.keep_checkpoints,
        )

    def load_checkpoint(self, directory: str) -> dict[str, Any]:
        self.step, extra = ckpt.load_checkpoint(directory, self.model, self.optimizer, self.scheduler)
        return extra
