"""Names and layouts between transformers' DeepSeek-V4 (what dsv4rl's checkpoints load into) and the
Megatron model, in both directions, for any tensor/pipeline/expert-parallel rank.

Each rule maps one Megatron parameter (name relative to a block, or a global one) to its transformers
name and says how it is split: replicated, rows or columns over tensor-parallel ranks, the shared
expert's fused gate/up rows (megatron's GLU keeps [gate_r; up_r] on rank r), or one routed expert
out of the stacked [E, ...] transformers tensor (experts are split over expert-parallel ranks, each
whole: expert-tensor-parallel is 1).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch import Tensor

from dsv4rl.train.megatron.tensor_source import StateDictSource, TensorSource


class Split(StrEnum):
    replicated = "replicated"
    tp_rows = "tp_rows"
    tp_vocab_rows = "tp_vocab_rows"  # rows over TP, the vocabulary padded to a multiple of TP first
    tp_columns = "tp_columns"
    tp_glu_rows = "tp_glu_rows"
    expert_fc1 = "expert_fc1"
    expert_fc2 = "expert_fc2"


@dataclass(frozen=True)
class Rule:
    megatron: str
    hf: str
    split: Split = Split.replicated


_ATTENTION = "self_attention."
_COMPRESSOR = _ATTENTION + "compressor."
_INDEXER = _ATTENTION + "indexer."
BLOCK_RULES: tuple[Rule, ...] = (
    Rule("input_layernorm.weight", "input_layernorm.weight"),
    Rule("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
    *(Rule(f"self_attention_hyper_connection.{p}", f"attn_hc.{p}") for p in ("fn", "base", "scale")),
    *(Rule(f"mlp_hyper_connection.{p}", f"ffn_hc.{p}") for p in ("fn", "base", "scale")),
    Rule(_ATTENTION + "attn_sink", "self_attn.sinks", Split.tp_rows),
    Rule(_ATTENTION + "linear_q_down_proj.weight", "self_attn.q_a_proj.weight"),
    Rule(_ATTENTION + "q_layernorm.weight", "self_attn.q_a_norm.weight"),
    Rule(_ATTENTION + "linear_q_up_proj.weight", "self_attn.q_b_proj.weight", Split.tp_rows),
    Rule(_ATTENTION + "linear_kv_proj.weight", "self_attn.kv_proj.weight"),
    Rule(_ATTENTION + "kv_layernorm.weight", "self_attn.kv_norm.weight"),
    Rule(_ATTENTION + "linear_o_group_proj", "self_attn.o_a_proj.weight", Split.tp_rows),
    Rule(_ATTENTION + "linear_proj.weight", "self_attn.o_b_proj.weight", Split.tp_columns),
    Rule(_COMPRESSOR + "linear_wkv.weight", "self_attn.compressor.kv_proj.weight"),
    Rule(_COMPRESSOR + "linear_wgate.weight", "self_attn.compressor.gate_proj.weight"),
    Rule(_COMPRESSOR + "norm.weight", "self_attn.compressor.kv_norm.weight"),
    Rule(_COMPRESSOR + "ape", "self_attn.compressor.position_bias"),
    Rule(_INDEXER + "compressor.linear_wkv.weight", "self_attn.compressor.indexer.kv_proj.weight"),
    Rule(_INDEXER + "compressor.linear_wgate.weight", "self_attn.compressor.indexer.gate_proj.weight"),
    Rule(_INDEXER + "compressor.norm.weight", "self_attn.compressor.indexer.kv_norm.weight"),
    Rule(_INDEXER + "compressor.ape", "self_attn.compressor.indexer.position_bias"),
    Rule(_INDEXER + "linear_wq_b.weight", "self_attn.compressor.indexer.q_b_proj.weight"),
    Rule(_INDEXER + "linear_weights_proj.weight", "self_attn.compressor.indexer.scorer.weights_proj.weight"),
    Rule("mlp.router.weight", "mlp.gate.weight"),
    Rule("mlp.router.expert_bias", "mlp.gate.e_score_correction_bias"),
    Rule("mlp.router.tid2eid", "mlp.gate.tid2eid"),
    Rule(
        "mlp.experts.local_experts.{expert}.linear_fc1.weight", "mlp.experts.gate_up_proj", Split.expert_fc1
    ),
    Rule("mlp.experts.local_experts.{expert}.linear_fc2.weight", "mlp.experts.down_proj", Split.expert_fc2),
    Rule(
        "mlp.shared_experts.linear_fc1.weight",
        "mlp.shared_experts.gate_proj.weight+mlp.shared_experts.up_proj.weight",
        Split.tp_glu_rows,
    ),
    Rule("mlp.shared_experts.linear_fc2.weight", "mlp.shared_experts.down_proj.weight", Split.tp_columns),
)
GLOBAL_RULES: tuple[Rule, ...] = (
    Rule("embedding.word_embeddings.weight", "model.embed_tokens.weight", Split.tp_vocab_rows),
    Rule("output_layer.weight", "lm_head.weight", Split.tp_vocab_rows),
    Rule("decoder.final_layernorm.weight", "model.norm.weight"),
    *(Rule(f"decoder.hc_head.{p}", f"model.hc_head.hc_{p}") for p in ("fn", "base", "scale")),
)
_BLOCK = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(.+)")
# Transformer Engine's grouped experts (TEGroupedMLP) hold local expert i as `linear_fc{1,2}.weight{i}`
_GROUPED_EXPERT = re.compile(r"mlp\.experts\.(linear_fc[12])\.weight(\d+)")


class UnmappedTensor(KeyError):
    """A Megatron tensor with no transformers counterpart (or the reverse): the mapping is incomplete."""


@dataclass(frozen=True)
class Placement:
    """Where one local Megatron tensor comes from: the transformers name(s), the split, the expert."""

    hf_names: tuple[str, ...]
    split: Split
    expert: int | None = None


@dataclass(frozen=True)
class Ranks:
    tensor: int = 0
    tensor_size: int = 1
    expert: int = 0
    expert_size: int = 1
    layer_offset: int = 0

    @classmethod
    def current(cls, layer_offset: int) -> Ranks:
        return cls(
            tensor=parallel_state.get_tensor_model_parallel_rank(),
            tensor_size=parallel_state.get_tensor_model_parallel_world_size(),
            expert=parallel_state.get_expert_model_parallel_rank(),
            expert_size=parallel_state.get_expert_model_parallel_world_size(),
            layer_offset=layer_offset,
        )


def placement(name: str, ranks: Ranks, num_experts: int) -> Placement:
    """The transformers source of the local Megatron tensor `name` on `ranks`."""
    for rule in GLOBAL_RULES:
        if rule.megatron == name:
            return Placement(tuple(rule.hf.split("+")), rule.split)
    match = _BLOCK.fullmatch(name)
    if match is None:
        raise UnmappedTensor(name)
    layer, rest = int(match.group(1)) + ranks.layer_offset, match.group(2)
    prefix = f"model.layers.{layer}."
    expert = None
    expert_match = _EXPERT.fullmatch(rest)
    grouped_match = _GROUPED_EXPERT.fullmatch(rest)
    if expert_match is not None:
        local = int(expert_match.group(1))
        expert = ranks.expert * (num_experts // ranks.expert_size) + local
        rest = f"mlp.experts.local_experts.{{expert}}.{expert_match.group(2)}"
    elif grouped_match is not None:
        local = int(grouped_match.group(2))
        expert = ranks.expert * (num_experts // ranks.expert_size) + local
        rest = f"mlp.experts.local_experts.{{expert}}.{grouped_match.group(1)}.weight"
    for rule in BLOCK_RULES:
        if rule.megatron == rest:
            return Placement(tuple(prefix + hf for hf in rule.hf.split("+")), rule.split, expert)
    raise UnmappedTensor(name)


def shard(source: TensorSource, where: Placement, ranks: Ranks) -> Tensor:
    """This rank's piece of the transformers tensor(s) named by `where`, read from `source`."""
    size, rank = ranks.tensor_size, ranks.tensor
    if where.split in (Split.expert_fc1, Split.expert_fc2):
        return source.expert(where.hf_names[0], where.expert)  # fc1 [2I, H] = cat[w1; w3], fc2 [H, I]
    tensors = [source.whole(name) for name in where.hf_names]
    if where.split == Split.replicated:
        return tensors[0]
    if where.split == Split.tp_rows:
        return tensors[0].chunk(size, dim=0)[rank]
    if where.split == Split.tp_vocab_rows:
        rows = tensors[0].shape[0]
        padded = torch.nn.functional.pad(tensors[0], (0, 0, 0, padded_vocab(rows, size) - rows))
        return padded.chunk(size, dim=0)[rank]
    if where.split == Split.tp_columns:
        return tensors[0].chunk(size, dim=1)[rank]
    gate, up = tensors  # tp_glu_rows
    return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]])


VOCAB_MULTIPLE = 128


def padded_vocab(vocab_size: int, tensor_parallel: int) -> int:
    """Megatron splits the vocabulary evenly over TP: the embedding and head carry zero rows (never
    looked up, their logits cut off) up to a multiple of 128 and of TP. With TP a power of two up to
    128 the padded size is the same at every layout, so checkpoints load across TP sizes; DeepSeek-V4's
    129280 is already a multiple of 128."""
    multiple = math.lcm(VOCAB_MULTIPLE, tensor_parallel)
    return -(-vocab_size // multiple) * multiple


def merge(pieces: list[Tensor], where: Placement, vocab_size: int) -> list[Tensor]:
    """The inverse of `shard` over all tensor-parallel pieces: the transformers tensor(s)."""
    if where.split == Split.replicated:
        return [pieces[0]]
    if where.split == Split.tp_rows:
        return [torch.cat(pieces, dim=0)]
    if where.split == Split.tp_vocab_rows:
        return [torch.cat(pieces, dim=0)[:vocab_size]]
    if where.split == Split.tp_columns:
        return [torch.cat(pieces, dim=1)]
    if where.split == Split.tp_glu_rows:
        halves = [piece.chunk(2, dim=0) for piece in pieces]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    return [pieces[0]]


def load_hf_state(model: torch.nn.Module, full: Mapping[str, Tensor], ranks: Ranks, num_experts: int) -> None:
    """`load_weights` from an in-memory transformers state dict."""
    load_weights(model, StateDictSource(full), ranks, num_experts)


@torch.no_grad()
def load_weights(model: torch.nn.Module, source: TensorSource, ranks: Ranks, num_experts: int) -> None:
    """Copy this rank's part of the weights into the Megatron model, tensor by tensor; every local
    tensor must have a source (else UnmappedTensor)."""
    for name, tensor in local_tensors(model):
        value = shard(source, placement(name, ranks, num_experts), ranks)
        if value.shape != tensor.shape:
            raise ValueError(
                f"{name}: transformers gives {tuple(value.shape)}, Megatron holds {tuple(tensor.shape)}"
            )
        tensor.copy_(value.to(tensor.dtype))


def local_tensors(model: torch.nn.Module) -> Iterator[tuple[str, Tensor]]:
    """The model's own tensors (parameters and persistent buffers); not megatron's `_extra_state`."""
    for name, tensor in model.state_dict().items():
        if isinstance(tensor, Tensor) and not name.endswith("._extra_state"):
            yield name, tensor


def _in_group(group: dist.ProcessGroup, rank: int) -> bool:
    return rank in dist.get_process_group_ranks(group)


def _collect(
    tensor: Tensor,
    group: dist.ProcessGroup | None,
    size: int,
    dst: int | None,
    into: list[Tensor] | None = None,
) -> list[Tensor] | None:
    """Every rank's `tensor` of `group`, in group-rank order: on every rank (`dst` None, an all-gather)
    or on `dst` only (a gather; None elsewhere). `into`: where the pieces land (else fresh tensors)."""
    receives = dst is None or dist.get_rank() == dst
    if size == 1:
        if into is not None and receives:
            into[0].copy_(tensor)
        return (into or [tensor]) if receives else None
    if receives and into is None:
        into = [torch.empty_like(tensor) for _ in range(size)]
    if dst is None:
        dist.all_gather(into, tensor.contiguous(), group=group)
    else:
        dist.gather(tensor.contiguous(), into if receives else None, dst=dst, group=group)
    return into if receives else None


def gather_stage(
    model: torch.nn.Module,
    ranks: Ranks,
    num_experts: int,
    values: Mapping[str, Tensor] | None = None,
    dst: int | None = None,
) -> Iterator[tuple[str, Tensor]]:
    """Full transformers-named tensors of this pipeline stage, merged over its tensor- and
    expert-parallel ranks, one at a time (collective over those groups).

    `dst` None: every rank of the stage gets every tensor. `dst` a global rank of the stage (its weight
    sender): only `dst` yields; the ranks of its tensor- and expert-parallel groups send it their pieces
    and hold nothing more, and the other ranks (replicas of those pieces) take no part. `values`
    replaces the model's own tensors by name (gradients, for instance); default the weights.

    A layer's routed experts are yielded as transformers' stacked [E, ...] tensor: gathered straight into
    it, one stacked tensor at a time (all of `gate_up_proj`, then all of `down_proj`).
    """
    tp_group = parallel_state.get_tensor_model_parallel_group() if ranks.tensor_size > 1 else None
    ep_group = parallel_state.get_expert_model_parallel_group() if ranks.expert_size > 1 else None
    rank = dist.get_rank()
    receives = dst is None or rank == dst
    # with a `dst`: whether dst gathers this rank's pieces (copies of them on other ranks sit it out)
    tp_member = dst is None or (rank == dst if tp_group is None else _in_group(tp_group, dst))
    ep_member = dst is None or (rank == dst if ep_group is None else _in_group(ep_group, dst))
    per_rank = num_experts // ranks.expert_size
    tensors = dict(local_tensors(model)) if values is None else values
    entries = [(name, placement(name, ranks, num_experts)) for name, _ in local_tensors(model)]
    experts_of: dict[str, list[tuple[str, Placement]]] = {}
    for name, where in entries:
        if where.expert is not None:
            experts_of.setdefault(where.hf_names[0], []).append((name, where))
    for name, where in entries:
        if where.expert is None:
            if not tp_member:
                continue
            if where.split == Split.replicated:
                pieces = [tensors[name]] if receives else None
            else:
                pieces = _collect(tensors[name], tp_group, ranks.tensor_size, dst)
            if pieces is not None:
                yield from zip(where.hf_names, merge(pieces, where, model.arch.vocab_size), strict=True)
            continue
        hf_name = where.hf_names[0]
        group = experts_of.pop(hf_name, None)
        if group is None:  # gathered with the first local expert of its stacked tensor
            continue
        if len(group) != per_rank:
            raise UnmappedTensor(f"{hf_name}: {len(group)} local experts, expected {per_rank}")
        if not ep_member:
            continue
        stacked = None
        for local_name, local_where in group:
            value = tensors[local_name]
            if receives and stacked is None:
                stacked = torch.empty((num_experts, *value.shape), dtype=value.dtype, device=value.device)
            local = local_where.expert - ranks.expert * per_rank
            into = [stacked[r * per_rank + local] for r in range(ranks.expert_size)] if receives else None
            _collect(value, ep_group, ranks.expert_size, dst, into)
        if stacked is not None:
            yield hf_name, stacked
