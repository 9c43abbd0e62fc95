"""megatron-core's process groups and pipeline schedule, set up from the recipe's `parallel.train` sizes.

`initialize` must run once per process after `torch.distributed.init_process_group` (torchrun): it
applies the CPU shims when there is no GPU, then builds megatron's TP/PP/EP/DP groups. `run_pipeline`
is the one entry to megatron's forward/backward schedules (no pipelining at PP=1, 1F1B otherwise);
the backend and the tests go through it, so the old-policy log-prob pass and the training pass share
the schedule.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor
from transformers import DeepseekV4Config

from dsv4rl.train.megatron import cpu_compat
from dsv4rl.train.megatron.architecture import DeepseekV4Architecture, ParallelSizes, transformer_config
from dsv4rl.train.megatron.model import DeepseekV4Model


def initialize(sizes: ParallelSizes) -> None:
    if not dist.is_initialized():
        raise RuntimeError("initialise torch.distributed first (torchrun; gloo on CPU, nccl on GPU)")
    world = dist.get_world_size()
    model_parallel = sizes.tensor * sizes.pipeline
    if world % model_parallel or (world // sizes.pipeline) % (sizes.expert * 1):
        raise ValueError(
            f"world size {world} does not divide into tensor {sizes.tensor} x pipeline {sizes.pipeline} "
            f"(x expert {sizes.expert} within data x tensor)"
        )
    cpu_compat.activate()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=sizes.tensor,
        pipeline_model_parallel_size=sizes.pipeline,
        expert_model_parallel_size=sizes.expert,
        expert_tensor_parallel_size=1,
    )


def build_stage(
    hf_config: DeepseekV4Config,
    sizes: ParallelSizes,
    dtype: torch.dtype,
    config: TransformerConfig | None = None,
) -> DeepseekV4Model:
    """This rank's pipeline stage of the model (weights uninitialised: load them next); `config`: the
    megatron config already built for it (default: built here for this machine)."""
    if config is None:
        arch = DeepseekV4Architecture.from_hf(hf_config)
        config = transformer_config(arch, sizes, dtype, on_cpu=cpu_compat.is_active())
    return DeepseekV4Model(
        config,
        hf_config,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        attention=sizes.attention,
        query_chunk=sizes.attention_query_chunk,
    )


LossFunction = Callable[[Tensor, dict[str, Tensor]], tuple[Tensor, dict[str, Any]]]


def run_pipeline(
    model: torch.nn.Module,
    micro_batches: Sequence[dict[str, Tensor]],
    loss_function: LossFunction,
    forward_only: bool,
) -> list[dict[str, Any]]:
    """Run every micro-batch (dicts with "input_ids" [B, S]; all of one shape) through megatron's
    schedule. On the last stage `loss_function(logits, micro_batch)` gives (loss to backpropagate,
    values to report); the reported values come back in order on the last stage, [] elsewhere."""
    if not micro_batches:
        return []
    batch, seq = micro_batches[0]["input_ids"].shape
    arch: DeepseekV4Architecture = _unwrap(model).arch

    def forward_step(data: Iterator[dict[str, Tensor]], stage: torch.nn.Module):
        micro = next(data)
        output = stage(micro["input_ids"], micro.get("choices"))  # choices: the replays (replay.py)
        return output, lambda logits: loss_function(logits, micro)

    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro_batches),
        model=[model],
        num_microbatches=len(micro_batches),
        seq_length=seq * arch.hc_mult,
        micro_batch_size=batch,
        forward_only=forward_only,
    )


def _unwrap(model: torch.nn.Module) -> DeepseekV4Model:
    while not isinstance(model, DeepseekV4Model):
        model = model.module
    return model
