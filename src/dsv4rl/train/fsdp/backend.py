"""The `fsdp` trainer backend: PyTorch FSDP2 (`fully_shard`) over a transformers DeepseekV4ForCausalLM.

One instance per training rank, inside an initialised default process group (torchrun). The same
code runs with gloo on CPU and nccl/rccl on GPUs. Every public method is collective: all ranks call
it, with the same number of sequences in `train_step` (shard the global batch with TrainBatch.shard).

With one rank there is nothing to shard, and the model stays a plain module: FSDP2's per-layer hooks,
parameter copies and DTensor dispatch are a measurable share of a small model's step (`sharded` says
which).
Checkpoints are the same either way: distributed checkpointing stores whole tensors by their global
offsets, so a run saved at one world size resumes at another.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from dsv4rl.algo.grpo import token_logprobs
from dsv4rl.config.schema import Config
from dsv4rl.model.native_checkpoint import load_native_model
from dsv4rl.model.replay import ReplayCounts
from dsv4rl.model.sglang_numerics import trainer_numerics
from dsv4rl.train import checkpoint as ckpt
from dsv4rl.train import replay, update
from dsv4rl.train.batch import TrainBatch
from dsv4rl.train.checkpoint_dirs import FINITE
from dsv4rl.train.freeze import FrozenTensors, freeze
from dsv4rl.train.nonfinite import require_finite_weights
from dsv4rl.train.update import MicroBatch, MicroLoss
from dsv4rl.train.weight_decay import param_groups


def default_device() -> torch.device:
    """cuda:LOCAL_RANK when CUDA is available, else cpu."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def full_tensor(tensor: Tensor) -> Tensor:
    """The whole of a (possibly sharded) parameter."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _local(tensor: Tensor) -> Tensor:
    """This rank's shard of a (possibly sharded) tensor, no communication."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class FSDPBackend:
    def __init__(self, cfg: Config, model_path: str, device: torch.device | None = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "the fsdp trainer backend needs an initialised default process group: run under torchrun "
                "and call torch.distributed.init_process_group (gloo on CPU, nccl on GPU) first"
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
        # the update loop's view (dsv4rl.train.update.UpdateBackend): every rank is a replica that holds
        # its own sums, and FSDP averages gradients over all of them
        self.gradient_average = self.world
        self.counts_loss_sums = self.counts_batch_sums = True
        self.frozen = FrozenTensors()  # train.freeze: set by _load before the model is sharded
        self.model = self._load(model_path, trainable=True)
        self.frozen.snapshot(self.local_weights())
        self.hf_config = self.model.config
        self.ref_model = self._load(model_path, trainable=False) if cfg.algo.kl_coef > 0 else None
        self.has_reference = self.ref_model is not None
        optim = cfg.optim
        self.optimizer = torch.optim.AdamW(
            # no decay for norms, sinks, mHC, position biases, the indexer (dsv4rl.train.weight_decay)
            param_groups(self.model.named_parameters(), optim.weight_decay),
            lr=optim.lr,
            betas=(float(optim.betas[0]), float(optim.betas[1])),
            eps=optim.eps,
            fused=True,  # one kernel for all parameters instead of one per tensor
        )
        self.step = 0  # completed train_step calls
        self.updates = 0  # optimizer steps taken (the learning-rate schedule's position)
        self.nonfinite_in_a_row = 0  # optimizer steps skipped since the last one taken
        self._norm: Tensor | None = None  # the norm grad_norm computed, for optimizer_step's clipping
        # False forces the separate old-policy forward even when the training forward could serve (tests)
        self.reuse_policy_forward = True
        self.replay_counts = ReplayCounts()  # the decisions replayed this step (algo.routing_replay, ...)

    # ------------------------------------------------------------------ model
    def _load(self, model_path: str, trainable: bool) -> torch.nn.Module:
        # A native checkpoint in any quant format, dequantized to the training dtype (float32).
        model = load_native_model(model_path, dtype=torch.float32)
        model.to(self.device)
        trainer_numerics(model, self.cfg)  # train.numerics.*: SGLang's rounding, straight-through
        # eval(): no dropout, so the trainer's logprobs match the rollout engine's and each other
        model.eval()
        model.requires_grad_(trainable)
        if trainable:  # train.freeze, before FSDP2 and the optimizer see which parameters train
            tensors = model.state_dict(keep_vars=True).items()  # transformers' names, before sharding
            self.frozen = freeze(
                tensors, self.cfg.train.freeze, lambda name: (name,), lambda _: self.rank == 0
            )
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
    def compute_logprobs(self, input_ids: Tensor, temperature: float = 1.0) -> Tensor:
        """log p(input_ids[:, t+1] | input_ids[:, :t+1]) of this rank's sequences, [B, T-1], no grad.
        Ranks may hold different numbers of sequences."""
        input_ids = input_ids.to(self.device)
        size = self.cfg.train.micro_batch_size
        chunks = list(input_ids.split(size)) if input_ids.shape[0] else []
        steps = self._sync_count(len(chunks))  # before any forward: collectives must pair up
        out = [self._micro_logprobs(self.model, chunk, temperature)[0] for chunk in chunks]
        dummy = torch.zeros(1, 2, dtype=torch.long, device=self.device)
        for _ in range(steps - len(chunks)):
            self._micro_logprobs(self.model, dummy, temperature)  # keep step with ranks that have more
        self._reshard(self.model)
        if not out:
            return torch.zeros(0, max(input_ids.shape[1] - 1, 0), device=self.device)
        return torch.cat(out)

    # ------------------------------------------------------------------ training (dsv4rl.train.update)
    def train_step(self, batch: TrainBatch, temperature: float | None = None) -> dict[str, float]:
        """One rollout batch (this rank's shard): algo.updates_per_step optimizer steps; with a replay on,
        the share of replayed decisions that differed (dsv4rl.train.replay)."""
        self.replay_counts = ReplayCounts()
        metrics = update.train_step(self, batch, temperature)
        return {**metrics, **replay.reduced_metrics(self.replay_counts, self.cfg.algo, self.device)}

    def data_parallel_all_reduce(
        self, tensor: Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
    ) -> None:
        dist.all_reduce(tensor, op=op)

    def micro_batches(self, mini: TrainBatch, row: int) -> list[MicroBatch]:
        """Each micro-batch trimmed on its own (FSDP's collectives do not depend on shapes)."""
        out = []
        for part in mini.micro_batches(self.cfg.train.micro_batch_size):
            out.append(MicroBatch(part.trimmed(), row, part.size))
            row += part.size
        return out

    @torch.no_grad()
    def forward_logprobs(
        self, micro: Sequence[MicroBatch], temperature: float, reference: bool = False
    ) -> list[Tensor]:
        model = self.ref_model if reference else self.model
        out = []
        for part in micro:
            with replay.replay(model, part.batch, self.cfg.algo, None):
                out.append(self._micro_logprobs(model, part.batch.input_ids, temperature)[0])
        self._reshard(model)
        return out

    def forward_backward(self, micro: Sequence[MicroBatch], loss: MicroLoss) -> Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        sums = []
        for part in micro:
            with replay.replay(self.model, part.batch, self.cfg.algo, self.replay_counts):
                logits = self.model(input_ids=part.batch.input_ids, use_cache=False).logits
            value, part_sums = loss(logits, part)
            value.backward()
            sums.append(part_sums)
        return torch.stack(sums).sum(dim=0)

    def grad_norm(self) -> float:
        """The gradient norm before clipping, over all ranks (what `clip_grad_norm_` computes first)."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        self._norm = torch.nn.utils.get_total_norm(grads)
        norm = self._norm.full_tensor() if isinstance(self._norm, DTensor) else self._norm
        return float(norm)

    def optimizer_step(self, lr: float) -> None:
        """Clip to optim.grad_clip by the norm `grad_norm` returned, and step at `lr`."""
        if self.cfg.optim.grad_clip > 0:
            params = [p for p in self.model.parameters() if p.grad is not None]
            torch.nn.utils.clip_grads_with_norm_(params, self.cfg.optim.grad_clip, self._norm)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def skip_step(self) -> None:
        """A non-finite step: the gradients go, the weights and Adam's state (its step count too) stay."""
        self.optimizer.zero_grad(set_to_none=True)

    def local_gradients(self) -> Iterator[tuple[str, Tensor]]:
        """This rank's shard of each gradient (the whole of it on one rank), parameter order."""
        for name, parameter in self.model.named_parameters():
            if parameter.grad is not None:
                yield name, _local(parameter.grad)

    def local_weights(self) -> Iterator[tuple[str, Tensor]]:
        """This rank's shard of each parameter and buffer of the policy (what the sync gathers)."""
        for name, tensor in itertools.chain(self.model.named_parameters(), self.model.named_buffers()):
            yield name, _local(tensor)

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
        """Refused (`NonFiniteError`) when a weight is non-finite, or when a frozen one changed
        (`FrozenTensorChanged`); marked finite (`checkpoint_dirs`)."""
        require_finite_weights(self, self.step, "checkpoint", f"{directory} was not written")
        self.frozen.check(self.local_weights(), f"step {self.step}'s checkpoint")
        return ckpt.save_checkpoint(
            directory,
            self.model,
            self.optimizer,
            {"step": self.step, "updates": self.updates, FINITE: True},
            extra_state,
            keep=self.cfg.train.keep_checkpoints,
        )

    def load_checkpoint(self, directory: str) -> dict[str, Any]:
        state, extra = ckpt.load_checkpoint(directory, self.model, self.optimizer)
        self.step, self.updates = int(state["step"]), int(state["updates"])
        self.frozen.snapshot(self.local_weights())  # frozen as the run resumes
        return extra
