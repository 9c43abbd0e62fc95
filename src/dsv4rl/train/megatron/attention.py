"""DeepSeek-V4 attention in megatron-core's tensor-parallel linears.

Shared by the three layer types: low-rank Q (wq_a -> q_norm -> wq_b, then a weightless per-head
RMSNorm), one shared KV head (wkv -> kv_norm, used as key and value), interleaved RoPE on the last
channels (un-rotated on the output, since V carried it), a learned per-head sink logit in the softmax
denominator, and a grouped low-rank output (wo_a per head group, then wo_b). Sliding layers see the
last `window` tokens; CSA and HCA layers also see compressed entries (`compressor.py`).

Tensor parallelism splits heads: wq_b is column-parallel, the sinks and wo_a's groups are split the
same way (o_groups must divide by TP), wo_b is row-parallel. wq_a, wkv and the compressors are
replicated; their outputs pass `shared_by_all_heads`, so every rank's copy receives the gradient
of all heads.

In bf16 the module rounds where SGLang's kernels do, not where transformers does: the per-head q
norm and the RoPE run in float32 with float32 tables, KV's norm and RoPE in float32 with one rounding,
and the attention core (logits, bias, sinks, softmax, the sum over values) in float32, rounded once on
its output (see `attend`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
    sharded_state_dict_default,
)
from torch import Tensor

from dsv4rl.config.choices import AttentionImpl
from dsv4rl.train.megatron import cpu_compat
from dsv4rl.train.megatron.architecture import AttentionKind, DeepseekV4Architecture
from dsv4rl.train.megatron.compressor import Compressor, Indexer, RMSNorm, linear, visible_entries
from dsv4rl.train.megatron.hyper_connection import unweighted_rms_norm
from dsv4rl.train.megatron.rope import RotaryTables, apply_interleaved_rope, rotate
from dsv4rl.train.megatron.sparse_attention import EntrySelection, sparse_attend


class _SumGradientsOverTensorParallel(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over the TP group. Like megatron's
    `copy_to_tensor_model_parallel_region`, whose backward all-reduces `grad.contiguous()` and returns
    the original, so a non-contiguous gradient (as attention's transposes produce) comes back unsummed."""

    @staticmethod
    def forward(ctx, tensor: Tensor) -> Tensor:  # noqa: ANN001
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # noqa: ANN001
        grad = grad.contiguous()
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())
        return grad


def shared_by_all_heads(tensor: Tensor) -> Tensor:
    """Mark a replicated tensor that feeds this rank's heads only: its gradient sums over all ranks."""
    return _SumGradientsOverTensorParallel.apply(tensor)


def sliding_window_bias(seq_len: int, window: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """[S, S] additive mask: query t sees keys t - window < s <= t."""
    position = torch.arange(seq_len, device=device)
    distance = position.view(-1, 1) - position.view(1, -1)
    allowed = (distance >= 0) & (distance < window)
    return torch.zeros(seq_len, seq_len, dtype=dtype, device=device).masked_fill(~allowed, float("-inf"))


class DeepseekV4Attention(MegatronModule):
    def __init__(self, config: TransformerConfig, arch: DeepseekV4Architecture, layer_index: int) -> None:
        super().__init__(config)
        self.arch, self.kind = arch, arch.attention_kinds[layer_index]
        tp = config.tensor_model_parallel_size
        if arch.num_heads % tp or arch.o_groups % tp:
            raise ValueError(
                f"tensor parallel size {tp} must divide num_attention_heads={arch.num_heads} and "
                f"o_groups={arch.o_groups}"
            )
        self.local_heads = arch.num_heads // tp
        self.local_groups = arch.o_groups // tp
        dtype, eps, hidden = config.params_dtype, config.layernorm_epsilon, config.hidden_size
        self.linear_q_down_proj = linear(hidden, arch.q_lora_rank, dtype)
        self.q_layernorm = RMSNorm(arch.q_lora_rank, eps)
        self.linear_q_up_proj = tensor_parallel.ColumnParallelLinear(
            arch.q_lora_rank,
            arch.num_heads * arch.head_dim,
            config=config,
            init_method=config.init_method,
            bias=False,
            gather_output=False,
        )
        self.linear_kv_proj = linear(hidden, arch.head_dim, dtype)
        self.kv_layernorm = RMSNorm(arch.head_dim, eps)
        group_width = arch.num_heads * arch.head_dim // arch.o_groups
        self.linear_o_group_proj = torch.nn.Parameter(
            torch.zeros(self.local_groups * arch.o_lora_rank, group_width, dtype=dtype)
        )
        set_tensor_model_parallel_attributes(self.linear_o_group_proj, True, 0, 1)
        self.linear_proj = tensor_parallel.RowParallelLinear(
            arch.o_groups * arch.o_lora_rank,
            hidden,
            config=config,
            init_method=config.output_layer_init_method,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=True,
        )
        self.attn_sink = torch.nn.Parameter(torch.zeros(self.local_heads, dtype=torch.float32))
        set_tensor_model_parallel_attributes(self.attn_sink, True, 0, 1)
        self.compressor: Compressor | None = None
        self.indexer: Indexer | None = None
        if self.kind != AttentionKind.sliding:
            ratio = arch.compress_ratio(self.kind)
            overlap = self.kind == AttentionKind.csa
            self.compressor = Compressor(config, ratio, arch.head_dim, arch.rope_dim, overlap=overlap)
            if overlap:
                self.indexer = Indexer(
                    config,
                    arch.q_lora_rank,
                    arch.index_heads,
                    arch.index_head_dim,
                    arch.index_topk,
                    ratio,
                    arch.rope_dim,
                )

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """megatron's distributed-checkpoint view: the sinks and the grouped projection are split over
        TP along their first axis (the parallel linears describe themselves)."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        tp_group = parallel_state.get_tensor_model_parallel_group()
        own: dict = {}
        self._save_to_state_dict(own, "", keep_vars=True)
        sharded = make_sharded_tensors_for_checkpoint(
            own,
            prefix,
            {"linear_o_group_proj": 0, "attn_sink": 0},
            sharded_offsets,
            tp_group=tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )
        for name, module in self.named_children():
            sharded.update(
                sharded_state_dict_default(
                    module, f"{prefix}{name}.", sharded_offsets, metadata, tp_group=tp_group
                )
            )
        return sharded

    def forward(self, hidden: Tensor, rope: dict[str, RotaryTables]) -> Tensor:
        """hidden [B, S, D] -> [B, S, D] (the row-parallel output, reduced over TP)."""
        arch = self.arch
        batch, seq, _ = hidden.shape
        tables = rope["main" if self.kind == AttentionKind.sliding else "compress"]
        positions = torch.arange(seq, device=hidden.device)
        cos, sin = tables.at(positions)  # float32 whatever hidden's dtype (rope.py)

        q_compressed = self.q_layernorm(self.linear_q_down_proj(hidden))
        q, _ = self.linear_q_up_proj(q_compressed)
        # SGLang's q kernel: the norm in float32, rounded once, then RoPE in float32, rounded once
        # (sglang/kernels/jit/csrc/deepseek_v4/main_norm_rope.cuh:133-151 and 175-197, called from
        # sglang/srt/models/deepseek_v4.py:1823)
        q = unweighted_rms_norm(q.view(batch, seq, self.local_heads, arch.head_dim), arch.norm_eps)
        q = apply_interleaved_rope(q, cos, sin)
        # SGLang's KV kernel keeps the weighted norm in float32 through RoPE and rounds once at the store
        # (sglang/kernels/jit/csrc/deepseek_v4/main_norm_rope.cuh:337-360 and 416-426); transformers
        # rounds after the norm and again after RoPE (modeling_deepseek_v4.py:832-833)
        kv = self.kv_layernorm(self.linear_kv_proj(hidden).float()).view(batch, seq, 1, arch.head_dim)
        kv = shared_by_all_heads(rotate(kv, cos, sin).to(hidden.dtype))
        keys = kv.squeeze(2)  # [B, S, d]
        if arch.attention == AttentionImpl.sparse:
            output = self._attend_sparse(hidden, q, q_compressed, keys, tables)
        else:
            output = self._attend_dense(hidden, q, q_compressed, keys, tables)
        # the inverse RoPE on the rounded output, in float32 (sglang/srt/models/deepseek_v4.py:2954-2960)
        output = apply_interleaved_rope(output, cos, -sin)
        grouped = output.reshape(batch * seq, self.local_groups, -1).transpose(0, 1)
        weight = self.linear_o_group_proj.view(self.local_groups, arch.o_lora_rank, -1).transpose(1, 2)
        grouped = torch.bmm(grouped, weight).transpose(0, 1).reshape(batch, seq, -1)
        out, _ = self.linear_proj(grouped)
        return out

    def _attend_dense(
        self, hidden: Tensor, q: Tensor, q_compressed: Tensor, keys: Tensor, tables: RotaryTables
    ) -> Tensor:
        """The reference form (parallel.train.attention=dense): [S, S + T] biases, one softmax."""
        batch, seq, _ = hidden.shape
        bias = sliding_window_bias(seq, self.arch.window, torch.float32, hidden.device).expand(
            batch, seq, seq
        )
        if self.compressor is not None:
            entries = shared_by_all_heads(self.compressor(hidden, tables))  # [B, T, d]
            if self.indexer is not None:
                entry_bias = self.indexer(
                    hidden, q_compressed.detach(), tables, self.arch.query_chunk
                ).float()
            else:
                visible = visible_entries(seq, entries.shape[1], self.compressor.ratio, hidden.device)
                entry_bias = (
                    torch.zeros(seq, entries.shape[1], device=hidden.device)
                    .masked_fill(~visible, float("-inf"))
                    .expand(batch, seq, -1)
                )
            keys = torch.cat([keys, entries], dim=1)
            bias = torch.cat([bias, entry_bias], dim=-1)
        if self.config.recompute_granularity == "selective" and torch.is_grad_enabled():
            # selective recompute: the [B, h, S, K] scores are rebuilt in backward, not kept
            return cpu_compat.recompute(self._attend, q, keys, bias)
        return self._attend(q, keys, bias)  # [B, S, h, d]

    def _attend_sparse(
        self, hidden: Tensor, q: Tensor, q_compressed: Tensor, keys: Tensor, tables: RotaryTables
    ) -> Tensor:
        """Each query chunk over its window and its entries only (`sparse_attention.py`), rebuilt in
        backward whatever the recompute setting; the indexer keeps nothing for backward."""
        entries = selection = None
        if self.compressor is not None:
            entries = shared_by_all_heads(self.compressor(hidden, tables))
            if self.indexer is not None:
                with torch.no_grad():  # top-k has no gradient: nothing of the scoring is kept for backward
                    selection = self.indexer.select(
                        hidden, q_compressed.detach(), tables, self.arch.query_chunk
                    )
            else:
                selection = EntrySelection(None, None, self.compressor.ratio)
        return sparse_attend(
            q,
            keys,
            self.arch.window,
            self.attn_sink,
            self.arch.head_dim**-0.5,
            entries=entries,
            selection=selection,
            query_chunk=self.arch.query_chunk,
            checkpoint=cpu_compat.recompute,
        )

    def _attend(self, q: Tensor, keys: Tensor, bias: Tensor) -> Tensor:
        return attend(q, keys, bias, self.attn_sink, self.arch.head_dim**-0.5)


def attend(q: Tensor, keys: Tensor, bias: Tensor, sinks: Tensor, scale: float) -> Tensor:
    """Softmax over keys plus the per-head sink (denominator only); q [B, S, h, d], keys [B, K, d],
    bias [B, S, K] additive, sinks [h]; -> [B, S, h, d] in q's dtype.

    All in float32, the result rounded once to q's dtype, as SGLang's sparse attention kernels do:
    q and K widened to float32 for the logits (sglang/kernels/ops/attention/flash_mla_sm120_triton.py:99,
    171), the softmax and the sum over values in float32 (:176-189), one rounding on the output
    (:203-204), the float32 sink (sglang/srt/models/deepseek_v4.py:1092) folded into the float32
    normaliser (flash_mla_sm120_triton.py:303-322). transformers keeps the logits in the activations'
    dtype (bf16) and only the sink-extended softmax in float32
    (transformers/models/deepseek_v4/modeling_deepseek_v4.py:740-753).
    """
    q32, keys32 = q.float(), keys.float()
    logits = torch.matmul(q32.transpose(1, 2), keys32.transpose(-1, -2).unsqueeze(1)) * scale
    logits = logits + bias.unsqueeze(1).float()  # [B, h, S, K]
    sink_logits = sinks.float().view(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
    combined = torch.cat([logits, sink_logits], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    return torch.matmul(probs, keys32.unsqueeze(1)).transpose(1, 2).to(q.dtype)
