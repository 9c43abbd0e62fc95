"""`train.freeze` in the trainer backends on the tiny model, under torchrun (gloo). Each backend, built with
`train.freeze=[router_gate, router_bias]`, trains one batch; what it froze, what its optimizer and
gradient buffers hold, what the sync sends before and after, and how it refuses a checkpoint once a frozen
tensor was changed behind its back go to OUT/results_world<W>.pt for test_freeze.py. World 1 runs both
backends (and megatron's refusal of an entry that matches half of one of its tensors); world 2 the `fsdp`
backend, whose FSDP2 then shards frozen and trained parameters side by side.

Usage: freeze_scenarios.py OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent / "fsdp"))  # the FSDP scenarios' helpers
from fsdp_scenarios import config, make_batch  # noqa: E402

from dsv4rl.config.choices import TrainBackend
from dsv4rl.config.schema import Config
from dsv4rl.model.freeze import FreezeError  # noqa: E402
from dsv4rl.model.model_dir import materialize_model  # noqa: E402
from dsv4rl.train.backend import build_backend  # noqa: E402
from dsv4rl.train.freeze import FrozenTensorChanged  # noqa: E402

GROUPS = ["router_gate", "router_bias"]


def synced(backend) -> dict[str, torch.Tensor]:  # noqa: ANN001
    return {name: tensor.clone().cpu() for name, tensor in backend.named_weights_for_sync()}


def refusal(cfg: Config, model_dir: str, freeze: list[str]) -> str:
    """The FreezeError a backend built with `freeze` raises (on every rank), or '' when it builds."""
    cfg.train.freeze = freeze
    try:
        build_backend(cfg, model_dir, None)
    except FreezeError as error:
        return str(error)
    return ""


def megatron_holdings(backend, names: dict[int, str], cfg: Config) -> dict:  # noqa: ANN001
    """What megatron-core builds from the DDP-wrapped model: the gradient buffers of its DDP, and the
    parameter groups of its distributed optimizer (the GPU path, built here from the same model)."""
    from megatron.core.optimizer import _get_param_groups
    from megatron.core.transformer.moe.router import TopKRouter

    from dsv4rl.train.megatron.optimizer import optimizer_config, weight_decay_overrides

    ddp = backend.ddp
    routers = [m for m in backend.model.modules() if m.__class__.__name__.endswith("Router")]
    # megatron's aux-loss-free balancing rewrites every `expert_bias` after a backward only with this flag
    # (finalize_model_grads), from the token counts its TopKRouter keeps; DeepSeek-V4's routers keep none
    out_of_reach = not backend.model.config.moe_router_enable_expert_bias and not any(
        isinstance(router, TopKRouter) for router in routers
    )
    groups = _get_param_groups([ddp], optimizer_config(cfg, torch.float32), weight_decay_overrides())
    buffers = ddp.buffers + ddp.expert_parallel_buffers
    return {
        "bias_update_out_of_reach": out_of_reach and len(routers) == 3,
        "megatron_gpu_groups": sorted(names[id(p)] for group in groups for p in group["params"]),
        "grad_buffers": sorted(names[id(p)] for buffer in buffers for p in buffer.params),
    }


def trained(cfg: Config, model_dir: str, out: dict) -> object:
    """Build with the groups frozen and train one batch; record names, optimizer state and weights."""
    cfg.train.freeze = list(GROUPS)
    cfg.optim.lr = 1e-2
    backend = build_backend(cfg, model_dir, None)
    module = getattr(backend, "ddp", backend.model)
    names = {id(p): name.removeprefix("module.") for name, p in module.named_parameters()}
    out["frozen"] = {name: list(entries) for name, entries in backend.frozen.names.items()}
    out["counts"] = {entry: (count.tensors, count.elements) for entry, count in backend.frozen.counts.items()}
    out["trainable"] = sorted(names[id(p)] for p in module.parameters() if p.requires_grad)
    out["parameters"] = sorted(names.values())
    out["initial"] = synced(backend)
    batch = make_batch(8, seed=3)
    grad_norm = backend.grad_norm

    def grad_norm_seeing_gradients() -> float:  # the gradients the norm and the step see
        out["gradients"] = sorted(name.removeprefix("module.") for name, _ in backend.local_gradients())
        return grad_norm()

    backend.grad_norm = grad_norm_seeing_gradients
    backend.train_step(batch.shard(backend.data_parallel_rank, backend.data_parallel_size), temperature=1.0)
    out["after"] = synced(backend)
    optimizer = getattr(backend.optimizer, "optimizer", backend.optimizer)  # megatron's CPU AdamW: torch's
    out["in_optimizer"] = sorted(names[id(p)] for group in optimizer.param_groups for p in group["params"])
    out["with_state"] = sorted(names[id(p)] for p, state in optimizer.state.items() if state)
    if cfg.parallel.train.backend == TrainBackend.megatron:
        out.update(megatron_holdings(backend, names, cfg))
    return backend


def main() -> None:
    out_dir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model_dir = str(out_dir / "model")
    if rank == 0:
        materialize_model(Config().model, model_dir)
    dist.barrier()
    results: dict = {}
    for name in ["fsdp", "megatron"] if world == 1 else ["fsdp"]:
        cfg = config()
        cfg.parallel.train.backend = TrainBackend(name)
        out = results[name] = {}
        backend = trained(cfg, model_dir, out)
        if rank == 0:  # a frozen tensor changed behind the trainer's back, on one rank: every rank refuses
            gate = dict(backend.local_weights())[next(iter(backend.frozen.names))]
            with torch.no_grad():
                gate.view(-1)[0] += 1.0
        try:
            backend.save_checkpoint(str(out_dir / f"{name}_checkpoints" / "step_00000001"), {})
            out["changed"] = ""
        except FrozenTensorChanged as error:
            out["changed"] = str(error)
        out["written"] = (out_dir / f"{name}_checkpoints" / "step_00000001").exists()
        del backend
        if name == "megatron":  # one megatron tensor holds the shared expert's gate and up rows
            out["partial"] = refusal(cfg, model_dir, ["glob:*.shared_experts.gate_proj.weight"])
    if rank == 0:
        torch.save(results, out_dir / f"results_world{world}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
