"""Rules on `dsv4rl plan`'s estimates: the assumptions' ranges, and the memory plan against the device.

A recipe whose GPUs need more memory than `cluster.device` has is refused before start, naming the GPU,
its biggest components and the fixes, unless `run.force_memory_plan=true`. The budget check runs only on
an otherwise valid recipe (`validate` calls it last): the estimate needs a layout that divides.
"""

from __future__ import annotations

from dsv4rl.checks.problems import Add
from dsv4rl.config.choices import DeviceKind
from dsv4rl.config.schema import Config
from dsv4rl.estimate.memory import GpuMemory, GpuRole, memory_plan

FORCE_KEY = "run.force_memory_plan"


def check_estimate(cfg: Config, add: Add) -> None:
    e = cfg.estimate
    if e.engine_tokens_per_s <= 0:
        add(f"estimate.engine_tokens_per_s must be > 0 (got {e.engine_tokens_per_s})")
    if not 0 < e.mfu <= 1:
        add(f"estimate.mfu must be in (0, 1] (got {e.mfu})")
    if not 0 < e.response_len_fraction <= 1:
        add(f"estimate.response_len_fraction must be in (0, 1] (got {e.response_len_fraction})")
    if e.mean_prompt_tokens < 0:
        add(f"estimate.mean_prompt_tokens must be >= 0 (got {e.mean_prompt_tokens})")
    if cfg.cluster.device != DeviceKind.cpu and cfg.cluster.gpus_per_node == 0:
        add(
            f"cluster.device={cfg.cluster.device.value} names a GPU but cluster.gpus_per_node=0 (CPU): set "
            "cluster.gpus_per_node, or cluster.device=cpu"
        )
    network = cfg.cluster.network_gb_per_s
    if network is not None and network <= 0:
        add(f"cluster.network_gb_per_s must be > 0 or null (got {network})")


def _biggest(gpu: GpuMemory, n: int = 3) -> str:
    parts = sorted(gpu.components_gb.items(), key=lambda kv: kv[1], reverse=True)[:n]
    return ", ".join(f"{name.replace('_', ' ')} {gb:.1f}" for name, gb in parts)


def over_budget_message(gpu: GpuMemory, device: str) -> str:
    """Why `gpu` does not fit, its biggest components, the fixes and the override."""
    has = f"a GPU has {gpu.device_gb:.0f} GB"
    if gpu.role == GpuRole.rollout and "static_gb" in gpu.details:
        need = (
            f"weights {gpu.components_gb['weights']:.1f} GB leave no KV cache in the static budget "
            f"{gpu.details['static_gb']:.1f} GB (parallel.rollout.mem_fraction_static "
            f"{gpu.details['static_fraction']:g} x {gpu.device_gb:.0f} GB)"
        )
    elif gpu.role == GpuRole.colocated:
        need = (
            f"needs {gpu.details['training_phase_gb']:.1f} GB while training ({has}) and, while the engine "
            f"generates, {gpu.details['resident_and_engine_weights_gb']:.1f} GB of trainer state and engine "
            f"weights before any KV cache, within a static budget of {gpu.details['static_gb']:.1f} GB "
            f"(biggest: {_biggest(gpu)} GB)"
        )
    else:
        need = f"needs {gpu.total_gb:.1f} GB, {has} (biggest: {_biggest(gpu)} GB)"
    fixes = "; ".join(gpu.fixes)
    return (
        f"memory plan (cluster.device={device}): {gpu.label} {need}. Fix: {fixes}; or set {FORCE_KEY}=true "
        "to start anyway (`dsv4rl plan` shows the estimate)"
    )


def check_memory_budget(cfg: Config, add: Add) -> None:
    """Refuse the worst GPU of each role that does not fit (nothing on CPU, nothing when forced)."""
    plan = memory_plan(cfg)
    if plan.forced:
        return
    worst: dict[GpuRole, GpuMemory] = {}
    for gpu in plan.gpus:
        if not gpu.fits and (gpu.role not in worst or gpu.total_gb > worst[gpu.role].total_gb):
            worst[gpu.role] = gpu
    for gpu in worst.values():
        add(over_budget_message(gpu, plan.device))
