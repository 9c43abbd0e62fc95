"""What every rule module shares: the problem sink and the layout facts derived from a recipe.

Lives apart from `validate` so the rule modules can import it without a cycle; `validate` re-exports
the facts, which are its public helpers.
"""

from __future__ import annotations

from collections.abc import Callable

from dsv4rl.config.schema import Config

Add = Callable[[str], None]


def data_parallel_size(cfg: Config) -> int:
    """Training data-parallel size: world / (tensor x pipeline x context parallel)."""
    t = cfg.parallel.train
    return (t.nnodes * t.nproc_per_node) // max(
        1, t.tensor_parallel * t.pipeline_parallel * t.context_parallel
    )


def num_layers(cfg: Config) -> int:
    """Decoder layers: the full model's fact when the recipe states it, else the tiny model's."""
    m = cfg.model
    return m.num_hidden_layers if m.num_hidden_layers is not None else m.tiny.num_hidden_layers


def stage_layers(cfg: Config) -> list[int]:
    """Decoder layers per pipeline stage: `last_stage_layers` on the last, the rest split evenly."""
    t, layers = cfg.parallel.train, num_layers(cfg)
    if t.pipeline_parallel == 1:
        return [layers]
    last = t.last_stage_layers if t.last_stage_layers is not None else layers // t.pipeline_parallel
    return [(layers - last) // (t.pipeline_parallel - 1)] * (t.pipeline_parallel - 1) + [last]


def num_routed_experts(cfg: Config) -> int:
    m = cfg.model
    return m.n_routed_experts if m.n_routed_experts is not None else m.tiny.n_routed_experts
