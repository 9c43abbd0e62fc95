"""The weights a rollout engine holds, held the way SGLang holds them, and the rules for replacing them.

SGLang keeps each parameter in the format its checkpoint declared (FP8 e4m3 weights with block scales,
int8-packed MXFP4 experts, BF16 norms, FP32 mHC ...) and loads an online update by copying into it. When
the update's dtype differs, SGLang either refuses halfway through a request ("Downcasting not allowed",
after other tensors of the request were already written) or casts silently, e.g. BF16 into FP8 bytes
read with the old scales. `HeldWeights` is stricter, so a wrong format is caught on CPU before it
corrupts an engine: every tensor of a request must have exactly the name, dtype and shape held, a
quantized weight must come with its scale, and partners SGLang fuses at load must share the request.
All of it is checked before any byte is received, and a request is written only once it fully arrived.

The engine's forward runs on a float model: after a commit, every changed (weight, scale) pair is
dequantized into it (`DeepseekWeights`).

`release` gives the memory back as SGLang's `/release_memory_occupation` does for "weights" (torch's meta
device keeps each tensor's name, dtype and shape, so update requests are still checked, but nothing can be
read); `restore` takes it back, zero-filled: like SGLang's resumed memory, the values are meaningless until
an update rewrites them, and `stale` names the tensors no update has rewritten yet.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from dsv4rl.model.naming import SCALE_SUFFIX, copy_native_into, scale_name, weight_name_of
from dsv4rl.quant.formats import dequantize
from dsv4rl.wire.layout import dtype_name, pair_key, parse_dtype

__all__ = ["DeepseekWeights", "HeldWeights", "PlannedTensor"]


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor of an accepted update request: what will be received for it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def _describe(dtype: torch.dtype | str, shape: Sequence[int]) -> str:
    name = dtype_name(dtype) if isinstance(dtype, torch.dtype) else dtype
    return f"{name} {list(shape)}"


class HeldWeights:
    """Named tensors in their held dtype; `plan` checks an update request, `commit` writes a received one.

    `apply(held, changed)` runs after each commit with the names written (the engine refreshes its
    forward model there). `served` describes the format for error messages (e.g. "fp8_mxfp4").
    """

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        apply: Callable[[Mapping[str, torch.Tensor], Iterable[str]], None] | None = None,
        served: str = "",
    ) -> None:
        self._held = {name: tensor.detach() for name, tensor in tensors.items()}
        self._apply = apply
        self.served = served
        self.lock = threading.RLock()
        self._stale: set[str] = set()

    def state(self) -> Mapping[str, torch.Tensor]:
        return self._held

    # ------------------------------------------------------------------------------------------ memory
    @property
    def released(self) -> bool:
        return any(tensor.is_meta for tensor in self._held.values())

    @property
    def stale(self) -> frozenset[str]:
        """Tensors whose memory was taken back by `restore` and that no update has rewritten since."""
        return frozenset(self._stale)

    def nbytes(self) -> int:
        """Bytes of memory held now (0 once released)."""
        return sum(_nbytes(t) for t in self._held.values() if not t.is_meta)

    def release(self) -> int:
        """Drop every held tensor's memory; returns the bytes given back."""
        with self.lock:
            freed = self.nbytes()
            self._held = {n: t.to("meta") for n, t in self._held.items()}
            return freed

    def restore(self) -> None:
        """Allocate every released tensor again, zero-filled and stale until an update rewrites it."""
        with self.lock:
            self._held = {n: _zeros_like(t) if t.is_meta else t for n, t in self._held.items()}
            self._stale = set(self._held)

    # ------------------------------------------------------------------------------------------ checks
    def plan(
        self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
    ) -> list[PlannedTensor]:
        """Every check of a request, before anything is received; ValueError names the first problem."""
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(
                f"names ({len(names)}), dtypes ({len(dtypes)}) and shapes ({len(shapes)}) "
                "must have the same length"
            )
        if not names:
            raise ValueError("the request names no tensors")
        duplicates = sorted(n for n, count in Counter(names).items() if count > 1)
        if duplicates:
            raise ValueError(f"tensor names repeat within one request: {duplicates[:5]}")
        planned = []
        for name, dtype_str, shape in zip(names, dtypes, shapes, strict=True):
            try:
                dtype = parse_dtype(dtype_str)
            except ValueError as error:
                raise ValueError(f"{name}: {error}") from None
            if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
                raise ValueError(f"{name}: shape {list(shape)} must be a list of non-negative integers")
            held = self._held.get(name)
            if held is None:
                examples = ", ".join(list(self._held)[:3])
                raise ValueError(
                    f"{name}: the engine holds no tensor of that name (it holds {len(self._held)} tensors "
                    f"under the checkpoint's native names, e.g. {examples})"
                )
            if held.dtype != dtype or tuple(held.shape) != tuple(shape):
                served = f" (it serves {self.served})" if self.served else ""
                raise ValueError(
                    f"{name}: the engine holds {_describe(held.dtype, held.shape)}{served}, the request "
                    f"sends {_describe(dtype_str, shape)}; nothing was received or written (SGLang would "
                    "refuse it partway or cast it silently): send the format the engine serves"
                )
            planned.append(PlannedTensor(name, dtype, tuple(shape)))
        self._check_scales(names)
        check_fused_pairs(names)
        return planned

    def _check_scales(self, names: Sequence[str]) -> None:
        """A quantized weight and its scale are one tensor to the engine: both or neither."""
        sent = set(names)
        for name in names:
            if name.endswith(SCALE_SUFFIX):
                partner = weight_name_of(name)
            elif name.endswith(".weight") and scale_name(name) in self._held:
                partner = scale_name(name)
            else:
                continue
            if partner not in sent:
                raise ValueError(
                    f"{name} arrived without {partner} in the same request: the engine dequantizes them "
                    "together, so one of them alone would be read against the other's old value; send both"
                )

    # ------------------------------------------------------------------------------------------ writes
    def commit(self, received: Mapping[str, torch.Tensor]) -> None:
        """Hold a fully received request (its tensors passed `plan`); takes ownership of the tensors."""
        with self.lock:
            if self.released:
                raise ValueError("the engine's weights are released: resume_memory_occupation first")
            for name, tensor in received.items():
                self._held[name] = tensor.detach().to(self._held[name].device)
            self._stale.difference_update(received)
            if self._apply is not None:
                self._apply(self._held, list(received))

    def relayout(self, names: Iterable[str]) -> None:
        """Permute each named tensor's elements in place (shape and dtype kept), as a weight shuffle run on
        an already shuffled layout does: the values end up in the wrong places."""
        self.commit({name: _rolled(self._held[name]) for name in names})

    def reset_random(self, skip: Iterable[str] = ()) -> int:
        """SGLang's weights_checker `reset_tensors`: random values everywhere but names containing `skip`."""
        skip = list(skip)
        names = [n for n in self._held if not any(pattern in n for pattern in skip)]
        self.commit({name: _random_like(self._held[name]) for name in names})
        return len(names)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _rolled(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s elements moved one place along its flattened order (bytes per element kept together)."""
    size = tensor.element_size()
    raw = tensor.contiguous().reshape(-1).view(torch.uint8).reshape(-1, size)
    return raw.roll(1, dims=0).reshape(-1).view(tensor.dtype).reshape(tensor.shape)


def _zeros_like(tensor: torch.Tensor) -> torch.Tensor:
    """All-zero bytes of `tensor`'s dtype and shape on the CPU (any dtype, E8M0 included)."""
    return torch.zeros(_nbytes(tensor), dtype=torch.uint8).view(tensor.dtype).reshape(tensor.shape)


def _random_like(tensor: torch.Tensor) -> torch.Tensor:
    """What SGLang's checker writes: uniform [0, 1) for floats, any value of the dtype for integers."""
    if tensor.dtype.is_floating_point:
        return torch.rand(tensor.shape).to(tensor.dtype)
    if tensor.dtype == torch.bool:
        return torch.rand(tensor.shape) > 0.5
    info = torch.iinfo(tensor.dtype)
    return torch.randint(int(info.min), int(info.max), tensor.shape, dtype=tensor.dtype)


def check_fused_pairs(names: Sequence[str]) -> None:
    """SGLang fuses wq_a+wkv and compressor wkv+wgate at load: a request must carry both halves."""
    members: dict[str, dict[str, set[str]]] = {}
    for name in names:
        paired = pair_key(name)
        if paired is not None and not paired[0].endswith(".wo_a"):  # wo_a pairs with its own scale
            key, kind, suffix = paired
            members.setdefault(key, {}).setdefault(kind, set()).add(suffix)
    for key, kinds in members.items():
        suffixes = list(kinds.values())
        if len(kinds) < 2 or any(s != suffixes[0] for s in suffixes):
            have = {kind: sorted(s) for kind, s in kinds.items()}
            raise ValueError(
                f"half of a fused pair in one request: {key} has {have}; SGLang fuses these at load time, so "
                "send both halves (weight and scale alike) in the same request"
            )


class DeepseekWeights(HeldWeights):
    """A DeepSeek-V4 checkpoint's tensors as stored, feeding a transformers model that runs the forward."""

    def __init__(
        self,
        model: torch.nn.Module,
        stored: Mapping[str, torch.Tensor],
        block: tuple[int, int],
        served: str = "",
    ) -> None:
        self.model = model
        self.block = block
        self._param_shapes: dict[str, torch.Size] = {}  # of the released parameters
        # The model's parameters and buffers by name, made once: state_dict() walks every module, a large
        # share of a small model's load. Release and restore swap a parameter's data, never the parameter.
        self._model_state = model.state_dict(keep_vars=True)
        # What the forward computes with, from a tensor's dequantized values (by native name); None: those
        # values (`engine.numerics=sglang` holds bf16 where SGLang does, dsv4rl.model.sglang_numerics)
        self.value_rule: Callable[[str, torch.Tensor], torch.Tensor] | None = None
        super().__init__(stored, self._dequantize_into_model, served)

    def refresh(self) -> None:
        """Write every held tensor into the forward model again (after `value_rule` changed)."""
        with self.lock:
            self._dequantize_into_model(self.state(), list(self.state()))

    @torch.no_grad()
    def _dequantize_into_model(self, held: Mapping[str, torch.Tensor], changed: Iterable[str]) -> None:
        weights = {weight_name_of(n) if n.endswith(SCALE_SUFFIX) else n for n in changed}
        state = self._model_state
        dtype = next(self.model.parameters()).dtype
        for name in sorted(weights):
            if name.startswith("mtp."):
                continue  # the transformers model has no MTP block
            scale = held.get(scale_name(name)) if name.endswith(".weight") else None
            value = dequantize(held[name], scale, self.block, dtype)
            if self.value_rule is not None:
                value = self.value_rule(name, value)
            copy_native_into(state, name, value)

    def nbytes(self) -> int:
        """The stored tensors plus the float model the forward runs on."""
        return super().nbytes() + sum(_nbytes(p) for p in self.model.parameters())

    @torch.no_grad()
    def release(self) -> int:
        """The forward model's parameters shrink to nothing too (a forward then fails instead of computing
        with stale values); its buffers stay, as SGLang keeps a model's static state across a release."""
        with self.lock:
            freed = self.nbytes()
            super().release()
            for name, param in self.model.named_parameters():
                self._param_shapes.setdefault(name, param.shape)
                param.data = torch.empty(0, dtype=param.dtype)
            return freed

    @torch.no_grad()
    def restore(self) -> None:
        with self.lock:
            super().restore()
            for name, param in self.model.named_parameters():
                if name in self._param_shapes:
                    param.data = torch.zeros(self._param_shapes.pop(name), dtype=param.dtype)
