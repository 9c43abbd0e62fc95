"""Run under torchrun on 2 processes (gloo): the megatron backend's weight export at EP=2, then at TP=2, with
the bytes of every tensor each rank allocates while it runs (a dispatch mode sees every new storage; views
and in-place writes allocate none). Writes OUT/results.pt on rank 0 for test_megatron_export.py.

Usage: export_scenarios.py OUT
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fsdp"))  # the FSDP scenarios' helpers
from fsdp_scenarios import config  # noqa: E402

from dsv4rl.config.choices import TrainBackend
from dsv4rl.model.model_dir import materialize_model  # noqa: E402
from dsv4rl.train.megatron import convert  # noqa: E402
from dsv4rl.train.megatron.backend import MegatronBackend  # noqa: E402

LAYOUTS = {"ep2": (1, 2), "tp2": (2, 1)}  # (tensor, expert)


class Allocations(TorchDispatchMode):
    """Sums the bytes of the storages that the ops run under it create (outputs not among the inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if _tensor(t)}
        for tensor in tree_flatten(out)[0]:
            if _tensor(tensor) and tensor.untyped_storage().data_ptr() not in inputs:
                size = tensor.untyped_storage().nbytes()
                self.bytes += size
                self.largest = max(self.largest, size)
        return out


def _tensor(value: object) -> bool:
    return isinstance(value, torch.Tensor)


def measured(export: Callable[[], Iterator[tuple[str, torch.Tensor]]]) -> dict:
    """Run an export to its end; what it yielded here (copied after) and what it allocated meanwhile."""
    with Allocations() as allocations:
        got = list(export())
    return {
        "tensors": {name: tensor.clone() for name, tensor in got},
        "bytes": allocations.bytes,
        "largest": allocations.largest,
    }


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0:
        materialize_model(config().model, str(out / "model"))
    dist.barrier()
    results: dict = {}
    for name, (tensor, expert) in LAYOUTS.items():
        cfg = config()
        cfg.parallel.train.backend = TrainBackend.megatron
        cfg.parallel.train.tensor_parallel, cfg.parallel.train.expert_parallel = tensor, expert
        backend = MegatronBackend(cfg, str(out / "model"))
        ranks, experts = backend.ranks(backend.model), backend.hf_config.n_routed_experts
        mine = {
            "sources": list(backend.weight_source_ranks),
            "by_stage": measured(lambda b=backend: b.named_weights_for_sync(by_stage=True)),
            "rank0": measured(lambda b=backend: b.named_weights_for_sync()),
            # every rank of the stage gets everything: what the export did before it gathered to its sender
            "every_rank": measured(lambda b=backend, r=ranks, e=experts: convert.gather_stage(b.model, r, e)),
        }
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        results[name] = every
        del backend
    if rank == 0:
        torch.save(results, out / "results.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
