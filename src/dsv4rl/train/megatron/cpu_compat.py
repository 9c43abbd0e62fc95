"""What megatron-core 0.16.1 needs to run on a machine without a GPU, in one place.

megatron-core is written for CUDA: it asks `torch.cuda.current_device()` where to put buffers, forks a
CUDA RNG state around tensor-parallel initialisation and dropout, and routes the MoE router GEMM
through Transformer Engine when it can import it. On CPU (tests, the tiny model, CI) dsv4rl applies
these shims, and only these; `activate()` does nothing when CUDA is available, so the GPU path runs
megatron-core unpatched.

1. `torch.cuda.current_device` returns "cpu", so the tensors megatron allocates "on the current
   device" land on the CPU.
2. The CUDA RNG tracker's `fork` is a no-op context: there is no CUDA RNG state to swap. dsv4rl builds
   weights with `use_cpu_initialization` and then loads them from a checkpoint, so no random draw
   depends on the fork.
3. `moe_utils.te_general_gemm = None`, so the router GEMM takes its plain `torch.mm` branch (without it
   the name is undefined when Transformer Engine is absent).
4. The pipeline schedules allocate their token counter with `device="cuda"` spelled out: their module
   sees a `torch` whose `zeros` puts such tensors on the CPU (everything else is torch itself).
5. `torch.cuda.synchronize` returns at once: without CUDA there is no queued device work to wait for
   (distributed checkpointing calls it after copying tensors to the host).

Other CPU constraints are configuration, not patches, and the model builder sets them itself on CPU:
`use_cpu_initialization=True`, `moe_token_dispatcher_type="allgather"` (gloo has no all-to-all),
`batch_p2p_comm=False` (the batched path calls `torch.cuda.synchronize`), no linear bias, no fused
kernels (`bias_activation_fusion`, `masked_softmax_fusion`, `gradient_accumulation_fusion` off), and
an explicit attention mask (dsv4rl's attention is its own, so megatron's fused softmax never runs).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator

import torch
import torch.utils.checkpoint

_ACTIVE = False


def needed() -> bool:
    """True when there is no CUDA device: megatron-core must run through the shims."""
    return not torch.cuda.is_available()


class _TorchWithCpuZeros(types.ModuleType):
    """torch, except that `zeros(..., device="cuda")` allocates on the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: object, **kwargs: object) -> torch.Tensor:
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        return torch.zeros(*args, **kwargs)


@contextlib.contextmanager
def _no_fork(*_args: object, **_kwargs: object) -> Iterator[None]:
    yield


def activate() -> bool:
    """Apply the shims once per process when there is no GPU; returns whether they are active."""
    global _ACTIVE
    if _ACTIVE or not needed():
        return _ACTIVE
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer.moe import moe_utils

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *_args, **_kwargs: None  # type: ignore[assignment]
    mcore_random.CudaRNGStatesTracker.fork = _no_fork  # type: ignore[method-assign]
    moe_utils.te_general_gemm = None
    schedules.torch = _TorchWithCpuZeros()
    _ACTIVE = True
    return True


def is_active() -> bool:
    return _ACTIVE


def recompute(function: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
    """Activation recompute: megatron's checkpoint on GPUs (it saves and restores the CUDA RNG
    tracker's states); torch's on CPU, where there is no CUDA RNG state and nothing random is drawn."""
    if _ACTIVE:
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)
    from megatron.core import tensor_parallel

    return tensor_parallel.checkpoint(function, False, *args)
