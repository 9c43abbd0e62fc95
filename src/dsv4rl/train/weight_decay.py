"""Which parameters weight decay applies to: one rule for both trainer backends.

Decay pulls a weight towards zero. That suits the matrices of the linears, the embedding and the head, but
not parameters that set a scale, an offset or a mixing rule: norms' gains, attention sinks, the mHC
(hyper-connection) projections, biases and scales, and the compressors' learned position biases (`ape`).
Decaying those only moves the model off its trained operating point. Nor does it suit the lightning
indexer, which the policy loss does not train. megatron-core's own rule (no decay
for 1-D parameters and biases, `megatron/core/optimizer/__init__.py:96`) reaches an optimizer only through
its `OptimizerParamScheduler` (`megatron/core/optimizer_param_scheduler.py:294`), which dsv4rl does not
use, and it would still decay the 2-D mHC projections and `ape`; so the rule lives here, on names both
backends share the words of: transformers' (`fsdp`) and dsv4rl's Megatron modules (`megatron`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

# the last name part of a parameter that is never decayed, in either backend's names
_NO_DECAY_LEAVES = frozenset(
    {
        "sinks",  # transformers: self_attn.sinks
        "attn_sink",  # megatron: self_attention.attn_sink
        "position_bias",  # transformers: compressor.position_bias
        "ape",  # megatron: compressor.ape
    }
)
# a module whose parameters are never decayed: mHC (transformers attn_hc / ffn_hc / hc_head, megatron
# *_hyper_connection / hc_head), and the lightning indexer: its top-k selection passes no gradient, so the
# policy loss never reaches it. torch's AdamW skips a parameter without a gradient, megatron's optimizers
# step every parameter of their gradient buffers (a zero gradient): decayed, it would shrink in the
# megatron backend alone.
_NO_DECAY_MODULES = frozenset({"attn_hc", "ffn_hc", "hc_head", "indexer"})


def decays(name: str, param: torch.Tensor) -> bool:
    """Whether weight decay applies to the parameter `name` (any prefix, e.g. DDP's `module.`)."""
    if param.ndim < 2 or name.endswith(".bias"):
        return False  # norms' gains, sinks, mHC base and scale, biases: megatron's own rule
    parts = name.split(".")
    if parts[-1] in _NO_DECAY_LEAVES or parts[-1].startswith("hc_"):  # transformers' hc_head.hc_fn
        return False
    for module in parts[:-1]:
        if module in _NO_DECAY_MODULES or module.endswith(("hyper_connection", "norm")):
            return False
    return True


def param_groups(
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]], weight_decay: float
) -> list[dict[str, Any]]:
    """torch optimizer groups of the trainable parameters: decayed first, then the rest at 0; empty
    groups left out (the order of the parameters is the optimizer's, and its state's ids)."""
    decayed: list[torch.nn.Parameter] = []
    kept: list[torch.nn.Parameter] = []
    for name, param in named_parameters:
        if param.requires_grad:
            (decayed if decays(name, param) else kept).append(param)
    groups = [{"params": decayed, "weight_decay": weight_decay}, {"params": kept, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]
