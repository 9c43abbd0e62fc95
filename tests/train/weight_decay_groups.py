"""Which of the tiny model's parameters each trainer backend's optimizer decays, by transformers name: the
`fsdp` backend's AdamW, the `megatron` backend's CPU AdamW, and the parameter groups megatron-core builds
for its distributed optimizer (GPU) with dsv4rl's overrides, at the decay `set_lr` gives them. A world of 1
(gloo). Usage: weight_decay_groups.py OUT.json; for test_weight_decay.py.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from megatron.core.optimizer import _get_param_groups

from dsv4rl.config.choices import TrainBackend
from dsv4rl.config.schema import Config
from dsv4rl.model.model_dir import materialize_model
from dsv4rl.train.fsdp.backend import FSDPBackend
from dsv4rl.train.megatron import convert
from dsv4rl.train.megatron.backend import MegatronBackend
from dsv4rl.train.megatron.optimizer import MegatronDistributedAdam, optimizer_config, weight_decay_overrides

WEIGHT_DECAY = 0.1


def by_decay(groups: list[dict], names: dict[int, list[str]]) -> dict[str, list[str]]:
    """{"<weight decay>": sorted transformers names} over the optimizer's groups."""
    out: dict[str, set[str]] = {}
    for group in groups:
        for param in group["params"]:
            out.setdefault(repr(float(group["weight_decay"])), set()).update(names[id(param)])
    return {decay: sorted(found) for decay, found in out.items()}


def megatron_names(backend: MegatronBackend) -> dict[int, list[str]]:
    """Each parameter of the DDP-wrapped model by its transformers name(s)."""
    ranks, experts = backend.ranks(backend.model), backend.hf_config.n_routed_experts
    return {
        id(param): list(convert.placement(name.removeprefix("module."), ranks, experts).hf_names)
        for name, param in backend.ddp.named_parameters()
    }


def main() -> None:
    out = Path(sys.argv[1])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = materialize_model(Config().model, str(Path(tmp) / "model"))
        cfg = Config()
        cfg.optim.weight_decay = WEIGHT_DECAY
        fsdp = FSDPBackend(cfg, model_dir)
        names = {id(param): [name] for name, param in fsdp.model.named_parameters()}
        result["fsdp"] = by_decay(fsdp.optimizer.param_groups, names)
        result["all"] = sorted(name for [name] in names.values())
        del fsdp

        cfg.parallel.train.backend = TrainBackend.megatron
        megatron = MegatronBackend(cfg, model_dir)
        names = megatron_names(megatron)
        result["megatron_cpu"] = by_decay(megatron.optimizer.optimizer.param_groups, names)
        # GPU: megatron's own parameter groups (what get_megatron_optimizer hands its optimizers; the
        # distributed optimizer keeps these group dicts), at the decay MegatronDistributedAdam.set_lr sets
        config = optimizer_config(cfg, torch.float32)
        groups = _get_param_groups([megatron.ddp], config, weight_decay_overrides())
        adam = MegatronDistributedAdam.__new__(MegatronDistributedAdam)
        adam.optimizer, adam.weight_decay = SimpleNamespace(param_groups=groups), config.weight_decay
        adam.set_lr(1e-3)
        result["megatron_gpu"] = by_decay(groups, names)
    out.write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
