"""Gradient finalisation and the optimizer of the megatron trainer backend.

Gradients: megatron-core's `DistributedDataParallel` buckets and reduces them over data-parallel
ranks (experts over expert-data-parallel ranks). dsv4rl's loss is already normalised by the global
token count (`dsv4rl.algo.loss`), so the reduction is a sum (`calculate_per_token_loss`) and
`finalize_gradients` passes no token count. Parameters computed on a tensor-parallel rank's share of
the tokens (the MoE router under the block's token split) are summed over TP here as well.

Optimizer: on GPUs megatron-core's distributed optimizer (Adam, fp32 main weights, gradient clipping
over all model-parallel ranks) with `parallel.train.optimizer_cpu_offload` / `optimizer_offload_fraction`.
Without a GPU megatron's optimizers cannot run (their CUDA type checks and streams), so
`ModelParallelAdamW` does the same step with torch's AdamW: the gradient norm counts each tensor once
across tensor-, data- and expert-data-parallel copies, then clips. Both decay only the parameters
`dsv4rl.train.weight_decay.decays` names, as the `fsdp` backend does.

A step is split in two so that the update loop can skip a non-finite one (`dsv4rl.train.nonfinite`):
`grad_norm` (the global pre-clip norm), then `step` (clip by that norm and update) or nothing at all.
megatron's own `step()` does not skip: only a loss scaler (fp16, or an explicit `loss_scale`) sets
`found_inf`, and dsv4rl trains bf16/fp32 without one, so a NaN gradient would reach the weights (the NaN
norm fails `clip_coeff < 1.0` and nothing is clipped). `MegatronDistributedAdam` therefore runs the parts
of `ChainedOptimizer.step` (`megatron/core/optimizer/optimizer.py:1308`) itself: `prepare_grads`,
`get_grad_norm`, clipping by that norm, `step_with_ready_grads`; a skipped step stops after the norm, which
changes no weight and no optimizer state (`prepare_grads` only copies gradients into the main gradients).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads

from dsv4rl.config.schema import Config
from dsv4rl.train.weight_decay import decays, param_groups

if TYPE_CHECKING:
    from megatron.core.optimizer import OptimizerConfig, ParamKey
    from megatron.core.optimizer_param_scheduler import ParamGroupOverride


def finalize_gradients(
    model: list[torch.nn.Module], num_tokens: torch.Tensor | None = None, **_: Any
) -> None:
    """megatron's schedule calls this after the last backward (config.finalize_model_grads_func)."""
    finalize_model_grads(model, None)
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return
    group = parallel_state.get_tensor_model_parallel_group()
    for chunk in model:
        for parameter in chunk.parameters():
            if getattr(parameter, "sequence_parallel", False) and parameter.requires_grad:
                dist.all_reduce(parameter.main_grad, group=group)


class StepOptimizer(Protocol):
    """What the backend needs: zero, set the learning rate, the pre-clip gradient norm, then a step
    clipped by that norm (or none: a skipped step only zeroes)."""

    def zero_grad(self) -> None: ...

    def set_lr(self, lr: float) -> None: ...

    def grad_norm(self) -> float: ...

    def step(self) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _is_expert(parameter: torch.nn.Parameter) -> bool:
    return not getattr(parameter, "allreduce", True)  # megatron marks expert parameters allreduce=False


def counted_once(parameter: torch.Tensor) -> bool:
    """Whether this rank's copy of the parameter (or buffer) counts in a sum over the model (the global
    gradient norm, `train.freeze`'s totals): one copy over data-parallel replicas and, unless split over
    tensor-parallel ranks, over those too."""
    if _is_expert(parameter):
        return parallel_state.get_expert_data_parallel_rank() == 0
    if parallel_state.get_data_parallel_rank() != 0:
        return False
    return (
        getattr(parameter, "tensor_model_parallel", False)
        or parallel_state.get_tensor_model_parallel_rank() == 0
    )


class ModelParallelAdamW:
    """torch AdamW on megatron's gradient buffers (`main_grad`), clipped by the model-parallel norm."""

    def __init__(self, model: torch.nn.Module, cfg: Config) -> None:
        optim = cfg.optim
        groups = param_groups(model.named_parameters(), optim.weight_decay)
        self.parameters = [p for group in groups for p in group["params"]]  # the state's id order
        self.grad_clip = optim.grad_clip
        self.norm = 0.0  # what grad_norm computed, for step's clipping
        self.optimizer = torch.optim.AdamW(
            groups, lr=optim.lr, betas=(float(optim.betas[0]), float(optim.betas[1])), eps=optim.eps
        )

    def zero_grad(self) -> None:
        for parameter in self.parameters:
            parameter.grad = None

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def grad_norm(self) -> float:
        squares = torch.zeros(1, dtype=torch.float64)
        for parameter in self.parameters:
            parameter.grad = parameter.main_grad.to(parameter.dtype)
            if counted_once(parameter):
                squares += parameter.grad.double().pow(2).sum().cpu()
        dist.all_reduce(squares)
        self.norm = math.sqrt(float(squares))
        return self.norm

    def step(self) -> None:
        if self.grad_clip > 0 and self.norm > self.grad_clip:
            torch._foreach_mul_([p.grad for p in self.parameters], self.grad_clip / (self.norm + 1e-6))
        self.optimizer.step()

    def initialise_state(self) -> None:
        """Adam's moments at zero for parameters that have none yet (what a checkpoint loads into)."""
        for parameter in self.parameters:
            state = self.optimizer.state[parameter]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(parameter, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(parameter, memory_format=torch.preserve_format)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)


def optimizer_config(cfg: Config, dtype: torch.dtype) -> OptimizerConfig:
    """megatron-core's config of its distributed optimizer for this recipe. Its `__post_init__` refuses
    what megatron cannot build (precision-aware without Transformer Engine raises a TypeError,
    `megatron/core/optimizer/optimizer_config.py:383`), so tests build it for every shipped recipe."""
    from megatron.core.optimizer import OptimizerConfig

    optim, train = cfg.optim, cfg.parallel.train
    return OptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        weight_decay=optim.weight_decay,
        adam_beta1=float(optim.betas[0]),
        adam_beta2=float(optim.betas[1]),
        adam_eps=optim.eps,
        clip_grad=optim.grad_clip,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        use_distributed_optimizer=True,
        optimizer_cpu_offload=train.optimizer_cpu_offload,
        optimizer_offload_fraction=train.optimizer_offload_fraction if train.optimizer_cpu_offload else 0.0,
        use_precision_aware_optimizer=train.precision_aware_optimizer,
    )


def weight_decay_overrides() -> dict[ParamKey, ParamGroupOverride]:
    """megatron's parameter-group overrides: `wd_mult` 0 for every parameter `decays` spares. Passed to
    `get_megatron_optimizer`, they replace megatron's default rule (1-D parameters and biases,
    `megatron/core/optimizer/__init__.py:96`), which they contain."""
    from megatron.core.optimizer import ParamKey, ParamWithNamePredicate
    from megatron.core.optimizer_param_scheduler import ParamGroupOverride

    spared = ParamWithNamePredicate(
        name="dsv4rl_no_weight_decay", fn=lambda param, name: not decays(name, param)
    )
    return {ParamKey(with_name_predicate=spared): ParamGroupOverride(wd_mult=0.0)}


class MegatronDistributedAdam:
    """megatron-core's distributed optimizer (GPU only), with the recipe's CPU offload fraction."""

    def __init__(self, model: torch.nn.Module, config: OptimizerConfig) -> None:
        from megatron.core.optimizer import get_megatron_optimizer

        self.weight_decay = config.weight_decay
        self.optimizer = get_megatron_optimizer(config, [model], config_overrides=weight_decay_overrides())
        self.norm = 0.0  # what grad_norm computed, for step's clipping
        self.set_lr(config.lr)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def set_lr(self, lr: float) -> None:
        """The learning rate, and each group's weight decay: megatron builds every group at the config's
        decay and leaves `wd_mult` to its OptimizerParamScheduler
        (`megatron/core/optimizer_param_scheduler.py:294`), which dsv4rl does not run."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
            group["weight_decay"] = self.weight_decay * group.get("wd_mult", 1.0)

    def grad_norm(self) -> float:
        """Gradients into the main (fp32) gradients, and their norm over every rank; NaN when a loss
        scaler found an Inf (a scaler also updates its scale here, as in megatron's own step)."""
        found_inf = self.optimizer.prepare_grads()
        self.norm = float(self.optimizer.get_grad_norm())
        return float("nan") if found_inf else self.norm

    def step(self) -> None:
        """Clip every part of the (chained) optimizer by the norm `grad_norm` returned, then update."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        for part in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            if getattr(part, "is_stub_optimizer", False) or part.config.clip_grad <= 0:
                continue
            parameters = part.get_parameters()
            if parameters:
                clip_grad_by_total_norm_fp32(
                    parameters,
                    max_norm=part.config.clip_grad,
                    total_norm=self.norm,
                    use_decoupled_grad=part.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
                )
        self.optimizer.step_with_ready_grads()

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)


def build_optimizer(model: torch.nn.Module, cfg: Config, config: OptimizerConfig | None) -> StepOptimizer:
    """AdamW (`optim.name`'s one choice): megatron's distributed optimizer from `config` (GPUs), torch's
    when there is none (CPU)."""
    if config is not None:
        return MegatronDistributedAdam(model, config)
    return ModelParallelAdamW(model, cfg)
