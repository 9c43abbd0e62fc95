"""Time per step of a recipe: rollout, training and weight sync, with and without async.

- Rollout: the tokens a step generates (prompts x group size x the mean response, `estimate.
  response_len_fraction` of `max_new_tokens`) over the engines' throughput (`estimate.
  engine_tokens_per_s` each). Prefill and DAPO's over-sampling are not counted.
- Training: FLOPs of the active parameters on the trained tokens (prompt, `estimate.mean_prompt_tokens`,
  plus response) over the training GPUs' peak dense BF16 at `estimate.mfu`. Per token and active
  parameter: 6 for forward and backward, 2 more for the forward full recompute repeats, 2 for an
  old-policy forward when `algo.updates_per_step > 1` (with one update the training forward's detached
  log-probs serve as the old ones: `algo.loss.reuses_policy_forward`), 2 for the reference model's
  forward when `algo.kl_coef > 0`. Attention-score FLOPs and the CPU part of
  an offloaded optimizer are not counted.
- Weight sync: the whole model in `quant`'s format over the link it crosses (the cluster's network per
  GPU when engines or stages sit on other nodes, the device's XGMI/NVLink on one node), at full
  bandwidth. The stages' buckets reach the engines one at a time, so the bytes add up. A colocated run
  is counted the same way (its shared-memory handover is not modelled).
- A step: rollout + train + sync; with async (one-step-off-policy: the rollout of step k+1 overlaps the
  training of step k) max(rollout, train) + sync. Colocated engines share the trainer's GPUs, so nothing
  overlaps there.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dsv4rl.config.choices import RecomputeMode
from dsv4rl.config.schema import Config
from dsv4rl.estimate.devices import GB, DeviceSpec, device_spec, network_gb_per_s
from dsv4rl.estimate.params import format_bytes, model_bytes, model_shape

FWD_BWD_FLOPS = 6  # per token and active parameter: forward 2, backward 4
FORWARD_FLOPS = 2


@dataclass(frozen=True)
class StepTime:
    rollout_s: float
    train_s: float
    sync_s: float
    step_s: float
    step_async_s: float
    generated_tokens: float
    trained_tokens: float
    flops_per_token_param: int
    train_flops: float
    sync_bytes: float
    assumptions: dict[str, float | int | str]

    def to_json(self) -> dict:
        return asdict(self)


def generated_tokens(prompts: int, group_size: int, max_new_tokens: int, response_fraction: float) -> float:
    return prompts * group_size * max_new_tokens * response_fraction


def flops_per_token_param(recompute: RecomputeMode, old_policy_forward: bool, reference_forward: bool) -> int:
    recompute_forward = recompute == RecomputeMode.full
    return FWD_BWD_FLOPS + FORWARD_FLOPS * (recompute_forward + old_policy_forward + reference_forward)


def train_seconds(flops: float, gpus: int, peak_tflops: float, mfu: float) -> float:
    return flops / (gpus * peak_tflops * 1e12 * mfu)


def step_seconds(rollout_s: float, train_s: float, sync_s: float, overlap: bool) -> float:
    return (max(rollout_s, train_s) if overlap else rollout_s + train_s) + sync_s


def _sync_link(cfg: Config, spec: DeviceSpec) -> tuple[float, str]:
    if cfg.cluster.nnodes > 1:
        source = "cluster.network_gb_per_s" if cfg.cluster.network_gb_per_s is not None else "400 Gb/s NIC"
        return network_gb_per_s(cfg, spec), f"between nodes ({source})"
    return spec.link_gb_per_s, f"{spec.name} links inside the node"


def step_time(cfg: Config) -> StepTime | None:
    """The estimate, or None where there is nothing to estimate against (CPU, missing model facts)."""
    spec, shape = device_spec(cfg), model_shape(cfg)
    if spec is None or shape is None:
        return None
    e, a, t, ro = cfg.estimate, cfg.algo, cfg.parallel.train, cfg.parallel.rollout
    generated = generated_tokens(
        a.prompts_per_step, a.group_size, a.sampling.max_new_tokens, e.response_len_fraction
    )
    trained = generated + a.prompts_per_step * a.group_size * e.mean_prompt_tokens
    per_token = flops_per_token_param(t.recompute, a.updates_per_step > 1, a.kl_coef > 0)
    flops = per_token * shape.active_params * trained
    gpus = t.nnodes * t.nproc_per_node
    rollout_s = generated / (ro.num_engines * e.engine_tokens_per_s)
    train_s = train_seconds(flops, gpus, spec.bf16_tflops, e.mfu)
    sync_bytes = model_bytes(shape, format_bytes(cfg.quant.name, cfg.model.dtype))
    bandwidth, link = _sync_link(cfg, spec)
    sync_s = sync_bytes / (bandwidth * GB)
    assumptions: dict[str, float | int | str] = {
        "engine_tokens_per_s": e.engine_tokens_per_s,
        "engines": ro.num_engines,
        "mean_response_tokens": a.sampling.max_new_tokens * e.response_len_fraction,
        "response_len_fraction": e.response_len_fraction,
        "mean_prompt_tokens": e.mean_prompt_tokens,
        "mfu": e.mfu,
        "train_gpus": gpus,
        "peak_bf16_tflops": spec.bf16_tflops,
        "active_params_b": shape.active_params / 1e9,
        "sync_gb_per_s": bandwidth,
        "sync_link": link,
        "quant": cfg.quant.name.value,
        "async_overlap": not cfg.parallel.colocate,
    }
    return StepTime(
        rollout_s=rollout_s,
        train_s=train_s,
        sync_s=sync_s,
        step_s=step_seconds(rollout_s, train_s, sync_s, overlap=False),
        step_async_s=step_seconds(rollout_s, train_s, sync_s, overlap=not cfg.parallel.colocate),
        generated_tokens=generated,
        trained_tokens=trained,
        flops_per_token_param=per_token,
        train_flops=flops,
        sync_bytes=sync_bytes,
        assumptions=assumptions,
    )
