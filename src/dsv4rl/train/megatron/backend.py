"""The `megatron` trainer backend: DeepSeek-V4 in megatron-core with the recipe's TP/PP/EP/DP layout.

Same protocol as the FSDP backend (`dsv4rl.train.backend.TrainerBackend`); every public method is
collective over all training ranks. The batch a rank receives is its data-parallel replica's share
(`data_parallel_rank` / `data_parallel_size`): the tensor- and pipeline-parallel ranks of one replica
get the same sequences. Every forward, the old-policy log-prob pass included, goes through megatron's
pipeline schedule on micro-batches of one shape per mini-batch (padding rows carry no loss), so the
old log-probs come from exactly the computation the update differentiates. The loss is
`dsv4rl.algo.loss.micro_batch_loss` on the last pipeline stage; this backend only runs the passes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor
from transformers import DeepseekV4Config

from dsv4rl.algo.grpo import token_logprobs
from dsv4rl.algo.loss import NUM_STEP_SUMS
from dsv4rl.config.choices import AttentionImpl, Dtype, RecomputeMode
from dsv4rl.config.schema import Config
from dsv4rl.model.native_checkpoint import (
    TORCH_DTYPES,
    is_native_checkpoint,
    load_hf_config,
    load_native_model,
)
from dsv4rl.model.replay import ReplayCounts
from dsv4rl.train import replay, update
from dsv4rl.train.batch import TrainBatch
from dsv4rl.train.checkpoint_dirs import FINITE
from dsv4rl.train.freeze import FrozenTensors, freeze
from dsv4rl.train.megatron import checkpoint, convert
from dsv4rl.train.megatron.architecture import DeepseekV4Architecture, ParallelSizes, transformer_config
from dsv4rl.train.megatron.model import DeepseekV4Model
from dsv4rl.train.megatron.optimizer import (
    build_optimizer,
    counted_once,
    finalize_gradients,
    optimizer_config,
)
from dsv4rl.train.megatron.parallel import build_stage, initialize, run_pipeline
from dsv4rl.train.megatron.replay import MicroChoices
from dsv4rl.train.megatron.tensor_source import NativeCheckpointSource, StateDictSource, TensorSource
from dsv4rl.train.nonfinite import require_finite_weights
from dsv4rl.train.update import MicroBatch, MicroLoss


def weight_source(model_path: str) -> tuple[DeepseekV4Config, TensorSource]:
    """The model's config and where each rank reads its own shard: a native checkpoint tensor by tensor
    (the whole model never sits on one rank), or a transformers directory loaded whole."""
    if is_native_checkpoint(model_path):
        return load_hf_config(model_path), NativeCheckpointSource(model_path)
    model = load_native_model(model_path, dtype=torch.float32)
    return model.config, StateDictSource(model.state_dict())


def parallel_sizes(cfg: Config) -> ParallelSizes:
    t = cfg.parallel.train
    return ParallelSizes(
        tensor=t.tensor_parallel,
        pipeline=t.pipeline_parallel,
        expert=t.expert_parallel,
        last_stage_layers=t.last_stage_layers,
        recompute=RecomputeMode(t.recompute),
        recompute_layers=t.recompute_granularity_layers,
        attention=AttentionImpl.dense if t.attention == AttentionImpl.dense else AttentionImpl.sparse,
        attention_query_chunk=t.attention_query_chunk,
    )


@dataclass(frozen=True)
class MegatronConfigs:
    """megatron-core's own configs of a run. Each `__post_init__` refuses what megatron cannot build, so
    building them is how a setting that cannot work fails before any rank loads weights
    (`tests/train/megatron/test_megatron_configs.py` builds them for every shipped recipe)."""

    transformer: TransformerConfig
    ddp: DistributedDataParallelConfig
    optimizer: OptimizerConfig | None  # None on CPU: megatron's optimizers need CUDA (ModelParallelAdamW)


def stage_config(cfg: Config, hf_config: DeepseekV4Config, on_gpu: bool) -> TransformerConfig:
    """megatron's config of one model (policy or reference) of this recipe."""
    dtype = TORCH_DTYPES[Dtype(cfg.model.dtype)]
    arch = DeepseekV4Architecture.from_hf(hf_config)
    return transformer_config(arch, parallel_sizes(cfg), dtype, on_cpu=not on_gpu)


def megatron_configs(cfg: Config, hf_config: DeepseekV4Config, on_gpu: bool) -> MegatronConfigs:
    """The configs the backend builds its model, DDP wrapper and optimizer from, on a GPU or not."""
    dtype = TORCH_DTYPES[Dtype(cfg.model.dtype)]
    return MegatronConfigs(
        transformer=stage_config(cfg, hf_config, on_gpu),
        ddp=DistributedDataParallelConfig(use_distributed_optimizer=on_gpu, grad_reduce_in_fp32=True),
        optimizer=optimizer_config(cfg, dtype) if on_gpu else None,
    )


class MegatronBackend:
    def __init__(self, cfg: Config, model_path: str, device: torch.device | None = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "the megatron trainer backend needs an initialised default process group (torchrun)"
            )
        self.cfg = cfg
        self.sizes = parallel_sizes(cfg)
        initialize(self.sizes)
        self.on_gpu = torch.cuda.is_available()
        self.device = device or (
            torch.device("cuda", torch.cuda.current_device()) if self.on_gpu else torch.device("cpu")
        )
        self.dtype = TORCH_DTYPES[Dtype(cfg.model.dtype)]
        self.hf_config, source = weight_source(model_path)
        self.configs = megatron_configs(cfg, self.hf_config, self.on_gpu)  # refused here, before loading
        self.model = self._build(source, self.configs.transformer, trainable=True)
        # train.freeze, before DDP's gradient buffers and the optimizer's groups are built
        self.frozen = self._freeze(self.model)
        if cfg.algo.kl_coef > 0:  # a config of its own: the policy's carries finalize_model_grads_func
            self.ref_model = self._build(source, stage_config(cfg, self.hf_config, self.on_gpu), False)
        else:
            self.ref_model = None
        self.ddp = DistributedDataParallel(self.model.config, self.configs.ddp, self.model)
        self.model.config.finalize_model_grads_func = finalize_gradients
        self.optimizer = build_optimizer(self.ddp, cfg, self.configs.optimizer)
        self.frozen.snapshot(self.local_weights())
        self.has_reference = self.ref_model is not None
        self.updates = 0  # optimizer steps taken (the learning-rate schedule's position)
        self.nonfinite_in_a_row = 0  # optimizer steps skipped since the last one taken
        self.step = 0  # completed train_step calls
        self.replay_counts = ReplayCounts()  # the decisions replayed this step (algo.routing_replay, ...)
        # False forces the separate old-policy forward even when the training forward could serve (tests)
        self.reuse_policy_forward = True
        self.data_parallel_rank = parallel_state.get_data_parallel_rank()
        self.data_parallel_size = parallel_state.get_data_parallel_world_size()
        self.last_stage = parallel_state.is_pipeline_last_stage()
        self.pipeline_group = parallel_state.get_pipeline_model_parallel_group()
        self.last_stage_rank = parallel_state.get_pipeline_model_parallel_last_rank()
        # the update loop's view (dsv4rl.train.update.UpdateBackend): megatron's gradient reduction sums;
        # one copy per replica of each sum counts: the loss terms where the last stage computes them, the
        # batch-derived ones (on every rank) at the first stage, each on tensor-parallel rank 0
        self.gradient_average = 1
        tensor_rank0 = parallel_state.get_tensor_model_parallel_rank() == 0
        self.counts_loss_sums = self.last_stage and tensor_rank0
        self.counts_batch_sums = parallel_state.is_pipeline_first_stage() and tensor_rank0
        # the ranks that send each stage's weights: global rank 0's pipeline group, stage by stage
        sources = [dist.get_process_group_ranks(self.pipeline_group) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(sources, src=0)
        self.stage_sources: list[int] = sources[0]

    def _build(self, source: TensorSource, config: TransformerConfig, trainable: bool) -> DeepseekV4Model:
        model = build_stage(self.hf_config, self.sizes, self.dtype, config)
        model.to(self.device)
        convert.load_weights(model, source, self.ranks(model), self.hf_config.n_routed_experts)
        model.eval()  # no dropout: the trainer's log-probs match the engines' and each other
        model.requires_grad_(trainable)
        return model

    def _freeze(self, model: DeepseekV4Model) -> FrozenTensors:
        """`train.freeze` by transformers' names: each tensor of this rank by the name(s) it loads from."""
        ranks, experts = self.ranks(model), self.hf_config.n_routed_experts
        tensors = [
            (name, tensor)
            for name, tensor in model.state_dict(keep_vars=True).items()
            if isinstance(tensor, Tensor) and not name.endswith("._extra_state")
        ]
        return freeze(
            tensors,
            self.cfg.train.freeze,
            lambda name: convert.placement(name, ranks, experts).hf_names,
            counted_once,
        )

    @staticmethod
    def ranks(model: DeepseekV4Model) -> convert.Ranks:
        return convert.Ranks.current(model.decoder.offset)

    # ------------------------------------------------------------------ forward passes
    def _pipeline_logprobs(
        self,
        model: torch.nn.Module,
        micro: list[Tensor],
        temperature: float,
        choices: list[MicroChoices | None] | None = None,
    ) -> list[Tensor]:
        """Per-micro-batch token log-probs, on every stage (sent from the last); `choices` replays the
        rollout's routing / indexer choices (algo.routing_replay, algo.indexer_replay)."""

        def report(logits: Tensor, data: dict[str, Tensor]):
            logprobs = token_logprobs(logits, data["input_ids"], temperature)
            return logprobs.sum() * 0.0, torch.tensor(1), {"logprobs": logprobs}

        with torch.no_grad():
            feeds = [
                {"input_ids": ids, "choices": c}
                for ids, c in zip(micro, choices or [None] * len(micro), strict=True)
            ]
            reported = run_pipeline(model, feeds, report, forward_only=True)
        out = []
        for index, ids in enumerate(micro):
            if self.last_stage:
                logprobs = reported[index]["logprobs"].float().contiguous()
            else:
                logprobs = torch.empty(ids.shape[0], ids.shape[1] - 1, device=self.device)
            if self.sizes.pipeline > 1:
                dist.broadcast(logprobs, src=self.last_stage_rank, group=self.pipeline_group)
            out.append(logprobs)
        return out

    def compute_logprobs(self, input_ids: Tensor, temperature: float = 1.0) -> Tensor:
        """log p(input_ids[:, t+1] | input_ids[:, :t+1]), [B, T-1], no grad, on every rank."""
        input_ids = input_ids.to(self.device)
        if input_ids.shape[0] == 0:
            return torch.zeros(0, max(input_ids.shape[1] - 1, 0), device=self.device)
        size = self.cfg.train.micro_batch_size
        chunks = list(input_ids.split(size))
        rows = chunks[-1].shape[0]
        if self.sizes.pipeline > 1 and rows < size:  # one shape for the schedule: repeat a row
            chunks[-1] = torch.cat([chunks[-1], chunks[-1][:1].expand(size - rows, -1)])
        return torch.cat(self._pipeline_logprobs(self.ddp, chunks, temperature))[: input_ids.shape[0]]

    # ------------------------------------------------------------------ training (dsv4rl.train.update)
    def train_step(self, batch: TrainBatch, temperature: float | None = None) -> dict[str, float]:
        """One rollout batch (this data-parallel replica's share): algo.updates_per_step optimizer steps;
        with a replay on, the share of replayed decisions that differed (summed over every rank: each
        counts its own tokens and layers; TP ranks repeat the indexer's, which leaves the share as is)."""
        self.replay_counts = ReplayCounts()
        metrics = update.train_step(self, batch, temperature)
        return {**metrics, **replay.reduced_metrics(self.replay_counts, self.cfg.algo, self.device)}

    def _choices(self, batch: TrainBatch, counts: ReplayCounts | None) -> MicroChoices | None:
        algo = self.cfg.algo
        if not (algo.routing_replay or algo.indexer_replay):
            return None
        routes, topk = replay.shaped_choices(batch, self.hf_config, algo)
        return MicroChoices(routes, topk, counts)

    def data_parallel_all_reduce(
        self, tensor: Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
    ) -> None:
        dist.all_reduce(tensor, op=op, group=parallel_state.get_data_parallel_group())

    def micro_batches(self, mini: TrainBatch, row: int) -> list[MicroBatch]:
        """The micro-batches of one mini-batch, trimmed together. With PP > 1 all have one shape (the
        schedules send fixed-shape tensors between stages): the last is padded with loss-free copies of
        its first row. With EP > 1 the replicas, whose experts exchange tokens, trim to one width."""
        width = mini.trimmed_width()
        if self.sizes.expert > 1:  # expert all-gathers span data-parallel replicas: one shape for all
            agreed = torch.tensor([width], device=self.device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=parallel_state.get_data_parallel_group())
            width = int(agreed)
        size = self.cfg.train.micro_batch_size
        out = []
        for part in mini.trimmed(width).micro_batches(size):
            out.append(MicroBatch(part, row, part.size))
            row += part.size
        last = out[-1]
        if self.sizes.pipeline > 1 and last.real < size:
            index = torch.cat([torch.arange(last.real), torch.zeros(size - last.real, dtype=torch.long)])
            padded = last.batch.select(index)
            keep = (torch.arange(size, device=padded.loss_mask.device) < last.real).to(padded.loss_mask.dtype)
            padded = dataclasses.replace(
                padded, loss_mask=padded.loss_mask * keep[:, None], advantages=padded.advantages * keep
            )
            out[-1] = MicroBatch(padded, last.row, last.real)
        return out

    def forward_logprobs(
        self, micro: Sequence[MicroBatch], temperature: float, reference: bool = False
    ) -> list[Tensor]:
        model = self.ref_model if reference else self.ddp
        choices = [self._choices(part.batch, None) for part in micro]
        return self._pipeline_logprobs(model, [part.batch.input_ids for part in micro], temperature, choices)

    def forward_backward(self, micro: Sequence[MicroBatch], loss: MicroLoss) -> Tensor:
        """Megatron's schedule over the micro-batches; the loss and its sums exist on the last stage."""

        def loss_function(logits: Tensor, data: dict[str, Any]):
            value, sums = loss(logits, data["micro"])
            return value, torch.tensor(1), {"sums": sums}

        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        feeds = [
            {
                "input_ids": part.batch.input_ids,
                "micro": part,
                "choices": self._choices(part.batch, self.replay_counts),
            }
            for part in micro
        ]
        reported = run_pipeline(self.ddp, feeds, loss_function, forward_only=False)
        sums = torch.zeros(NUM_STEP_SUMS, dtype=torch.float64, device=self.device)
        for item in reported:
            sums += item["sums"]
        return sums

    def grad_norm(self) -> float:
        return self.optimizer.grad_norm()

    def optimizer_step(self, lr: float) -> None:
        self.optimizer.set_lr(lr)
        self.optimizer.step()

    def skip_step(self) -> None:
        self.optimizer.zero_grad()

    def local_gradients(self) -> Iterator[tuple[str, Tensor]]:
        """This rank's gradient buffers (`main_grad`; megatron's names), parameter order."""
        for name, parameter in self.model.named_parameters():
            grad = getattr(parameter, "main_grad", None)
            if grad is not None:
                yield name, grad

    def local_weights(self) -> Iterator[tuple[str, Tensor]]:
        """This rank's parameters and buffers of the policy (its stage, its TP and EP shards)."""
        yield from self.model.named_parameters()
        yield from self.model.named_buffers()

    # ------------------------------------------------------------------ weights and checkpoints
    @property
    def weight_source_ranks(self) -> list[int]:
        """The global rank that sends each pipeline stage's weights (the stage's first rank)."""
        return list(self.stage_sources)

    @torch.no_grad()
    def named_weights_for_sync(self, by_stage: bool = False) -> Iterator[tuple[str, Tensor]]:
        """Full tensors, transformers names, one at a time (collective).

        Each pipeline stage merges its tensor- and expert-parallel shards on its source rank
        (`weight_source_ranks`) only: the stage's other ranks send their pieces and allocate nothing.
        `by_stage`: every source yields its own stage's tensors, all stages at once, for a sync with one
        sender per stage. Otherwise rank 0 yields them all: stage 0's as they are merged, then the other
        stages' received from their source tensor by tensor. Either way no rank ever holds the whole
        model, and a source holds one merged tensor at a time (a layer's stacked experts at most).
        """
        ranks = self.ranks(self.model)
        stage = parallel_state.get_pipeline_model_parallel_rank()
        experts = self.hf_config.n_routed_experts
        rank = dist.get_rank()
        if by_stage:
            own_source = self.stage_sources[stage]
            for name, tensor in convert.gather_stage(self.model, ranks, experts, dst=own_source):
                yield name, tensor.detach()
            return
        for source_stage, source in enumerate(self.stage_sources):
            if stage == source_stage:
                for name, tensor in convert.gather_stage(self.model, ranks, experts, dst=source):
                    if rank == 0:
                        yield name, tensor.detach()
                    elif rank == source:
                        dist.send_object_list([(name, tensor.shape, tensor.dtype)], dst=0)
                        dist.send(tensor.contiguous(), dst=0)
                if rank == source and rank != 0:
                    dist.send_object_list([None], dst=0)
            elif rank == 0:
                while True:
                    header: list = [None]
                    dist.recv_object_list(header, src=source)
                    if header[0] is None:
                        break
                    name, shape, dtype = header[0]
                    tensor = torch.empty(shape, dtype=dtype, device=self.device)
                    dist.recv(tensor, src=source)
                    yield name, tensor

    def save_checkpoint(self, directory: str, extra_state: dict[str, Any]) -> Path:
        """Refused (`NonFiniteError`) when a weight is non-finite, or when a frozen one changed
        (`FrozenTensorChanged`); marked finite (`checkpoint_dirs`)."""
        require_finite_weights(self, self.step, "checkpoint", f"{directory} was not written")
        self.frozen.check(self.local_weights(), f"step {self.step}'s checkpoint")
        counters = {"step": self.step, "updates": self.updates, FINITE: True}
        keep = self.cfg.train.keep_checkpoints
        frozen = checkpoint.Frozen(list(self.cfg.train.freeze), sorted(self.frozen.everywhere))
        return checkpoint.save_checkpoint(
            self.model, self.optimizer, counters, directory, extra_state, keep, frozen
        )

    def load_checkpoint(self, directory: str) -> dict[str, Any]:
        frozen = checkpoint.Frozen(list(self.cfg.train.freeze), sorted(self.frozen.everywhere))
        counters, extra = checkpoint.load_checkpoint(self.model, self.optimizer, directory, frozen)
        self.step, self.updates = counters["step"], counters["updates"]
        self.frozen.snapshot(self.local_weights())  # frozen as the run resumes
        return extra
