"""DeepSeek-V4's shape, read once from the checkpoint's transformers config, and the megatron-core
`TransformerConfig` built from it and the recipe's parallel layout.

megatron-core's config carries what its own modules read (hidden size, experts, top-k, the clamped
SwiGLU, the parallel sizes); `DeepseekV4Architecture` carries what only DeepSeek-V4's modules need
(layer types, low-rank and grouped projections, compressors, indexer, mHC).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig
from transformers import DeepseekV4Config

from dsv4rl.config.choices import AttentionImpl, RecomputeMode
from dsv4rl.train.megatron.moe import grouped_experts_available


class AttentionKind(StrEnum):
    sliding = "sliding_attention"
    csa = "compressed_sparse_attention"
    hca = "heavily_compressed_attention"


class RoutingKind(StrEnum):
    hash = "hash_moe"
    score = "moe"


@dataclass(frozen=True)
class DeepseekV4Architecture:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    attention_kinds: tuple[AttentionKind, ...]
    routing_kinds: tuple[RoutingKind, ...]
    csa_ratio: int
    hca_ratio: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    num_experts: int
    experts_per_token: int
    shared_experts: int
    expert_width: int
    route_scale: float
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    norm_eps: float
    # how, not what: the attention core's form (sparse or the dense reference) and its query chunk
    attention: AttentionImpl = AttentionImpl.sparse
    query_chunk: int = 256

    @classmethod
    def from_hf(cls, config: DeepseekV4Config) -> DeepseekV4Architecture:
        if config.scoring_func != "sqrtsoftplus" or not config.norm_topk_prob:
            raise ValueError(
                f"scoring_func={config.scoring_func!r}, norm_topk_prob={config.norm_topk_prob}: the megatron "
                "backend implements DeepSeek-V4's sqrtsoftplus scores renormalised over the top-k"
            )
        head_dim = config.head_dim
        rope_factor = config.rope_parameters["main"].get("partial_rotary_factor", 1.0)
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            head_dim=head_dim,
            rope_dim=int(head_dim * rope_factor),
            q_lora_rank=config.q_lora_rank,
            o_groups=config.o_groups,
            o_lora_rank=config.o_lora_rank,
            window=config.sliding_window,
            attention_kinds=tuple(AttentionKind(t) for t in config.layer_types[: config.num_hidden_layers]),
            routing_kinds=tuple(RoutingKind(t) for t in config.mlp_layer_types[: config.num_hidden_layers]),
            csa_ratio=config.compress_rates[AttentionKind.csa.value],
            hca_ratio=config.compress_rates[AttentionKind.hca.value],
            index_heads=config.index_n_heads,
            index_head_dim=config.index_head_dim,
            index_topk=config.index_topk,
            num_experts=config.n_routed_experts,
            experts_per_token=config.num_experts_per_tok,
            shared_experts=config.n_shared_experts,
            expert_width=config.moe_intermediate_size,
            route_scale=float(config.routed_scaling_factor),
            swiglu_limit=float(config.swiglu_limit),
            hc_mult=config.hc_mult,
            hc_sinkhorn_iters=config.hc_sinkhorn_iters,
            hc_eps=float(config.hc_eps),
            norm_eps=float(config.rms_norm_eps),
        )

    def compress_ratio(self, kind: AttentionKind) -> int:
        return {AttentionKind.csa: self.csa_ratio, AttentionKind.hca: self.hca_ratio}[kind]


@dataclass(frozen=True)
class ParallelSizes:
    tensor: int = 1
    pipeline: int = 1
    expert: int = 1
    last_stage_layers: int | None = None
    recompute: RecomputeMode = RecomputeMode.none
    recompute_layers: int = 1  # blocks per recomputed chunk (full recompute)
    attention: AttentionImpl = AttentionImpl.sparse
    attention_query_chunk: int = 256


def transformer_config(
    arch: DeepseekV4Architecture, sizes: ParallelSizes, dtype: torch.dtype, on_cpu: bool
) -> TransformerConfig:
    """megatron-core's config for this model: its MoE layer, parallel linears and schedules read it."""
    mode = RecomputeMode(sizes.recompute)
    recompute = {} if mode == RecomputeMode.none else {"recompute_granularity": mode.value}
    if mode == RecomputeMode.full:
        recompute.update(recompute_method="uniform", recompute_num_layers=sizes.recompute_layers)
    # the experts in Transformer Engine's grouped GEMM where it is present (GPUs), else SequentialMLP (moe.py)
    grouped = not on_cpu and grouped_experts_available()
    layout = {}
    if sizes.pipeline > 1 and sizes.last_stage_layers is not None:
        layout["num_layers_in_last_pipeline_stage"] = sizes.last_stage_layers
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.expert_width,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_eps,
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        activation_func_clamp_value=arch.swiglu_limit,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        num_moe_experts=arch.num_experts,
        moe_router_topk=arch.experts_per_token,
        moe_ffn_hidden_size=arch.expert_width,
        moe_shared_expert_intermediate_size=arch.expert_width * arch.shared_experts or None,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="allgather" if on_cpu else "alltoall",
        batch_p2p_comm=not on_cpu,
        moe_router_dtype="fp32",
        moe_grouped_gemm=grouped,
        tensor_model_parallel_size=sizes.tensor,
        pipeline_model_parallel_size=sizes.pipeline,
        expert_model_parallel_size=sizes.expert,
        expert_tensor_parallel_size=1,
        sequence_parallel=False,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        # the loss function returns sums already normalised by dsv4rl.algo.loss: no division by the
        # number of micro-batches in the schedule
        calculate_per_token_loss=True,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True,
        perform_initialization=False,
        **recompute,
        **layout,
    )
