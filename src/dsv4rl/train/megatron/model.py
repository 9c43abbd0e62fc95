"""DeepSeek-V4 as a megatron-core model: embedding -> blocks with mHC streams -> hc_head -> norm -> head.

One instance is one pipeline stage: the first stage owns the embedding, the last the stream
contraction, final norm and output layer, and every stage its slice of the blocks (megatron-core's
layer split, including `num_layers_in_last_pipeline_stage`). Between stages the residual travels as
megatron's pipeline tensor: the [B, S, N, D] streams are laid out [S * N, B, D], so the schedules'
(seq_length * hc_mult, micro_batch, hidden) shape carries them unchanged.

A block is `hc_pre -> attn_norm -> attention -> hc_post`, then `hc_pre -> ffn_norm -> MoE -> hc_post`.
Full recompute keeps only the input of every `recompute_num_layers` blocks (the recipe's
`recompute_granularity_layers`); selective recompute only the attention core (`attention.py`).
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.utils import apply_prefix_mapping
from megatron.core.enums import ModelType
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.transformer.utils import sharded_state_dict_default
from torch import Tensor
from transformers import DeepseekV4Config

from dsv4rl.config.choices import AttentionImpl
from dsv4rl.model.replay import NO_CHOICE
from dsv4rl.train.megatron import cpu_compat
from dsv4rl.train.megatron.architecture import AttentionKind, DeepseekV4Architecture, RoutingKind
from dsv4rl.train.megatron.attention import DeepseekV4Attention
from dsv4rl.train.megatron.compressor import RMSNorm
from dsv4rl.train.megatron.convert import padded_vocab
from dsv4rl.train.megatron.hyper_connection import HyperConnection, HyperHead, expand
from dsv4rl.train.megatron.moe import HashRouter, moe_spec
from dsv4rl.train.megatron.replay import MicroChoices
from dsv4rl.train.megatron.rope import RotaryTables, rotary_tables


def mark_tensor_parallel_weights(model: torch.nn.Module) -> None:
    """Tag the parallel linears' weights as split over TP (axis, stride 1). megatron-core tags them only
    when it initialises them itself; dsv4rl builds with `perform_initialization=False` and loads the
    checkpoint, and the optimizer's gradient norm reads the tags."""
    for module in model.modules():
        if isinstance(module, (tensor_parallel.ColumnParallelLinear, tensor_parallel.VocabParallelEmbedding)):
            set_tensor_model_parallel_attributes(module.weight, True, 0, 1)
        elif isinstance(module, tensor_parallel.RowParallelLinear):
            set_tensor_model_parallel_attributes(module.weight, True, 1, 1)


class DeepseekV4Block(MegatronModule):
    def __init__(self, config: TransformerConfig, arch: DeepseekV4Architecture, layer_index: int) -> None:
        super().__init__(config)
        self.layer_index = layer_index
        hc = (arch.hc_mult, arch.hc_sinkhorn_iters, arch.hc_eps)
        self.self_attention_hyper_connection = HyperConnection(config, *hc)
        self.mlp_hyper_connection = HyperConnection(config, *hc)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.norm_eps)
        self.pre_mlp_layernorm = RMSNorm(arch.hidden_size, arch.norm_eps)
        self.self_attention = DeepseekV4Attention(config, arch, layer_index)
        # this layer's place among the CSA layers: its column of the indexer choices SGLang returns
        self.csa_slot = arch.attention_kinds[:layer_index].count(AttentionKind.csa)
        hash_routed = arch.routing_kinds[layer_index] == RoutingKind.hash
        # megatron's MoE layer expects sequence-parallel input under TP (each rank its own tokens);
        # the attention is not sequence-parallel, so the block splits the tokens around the MoE only
        self.tensor_parallel_size = config.tensor_model_parallel_size
        moe_config = (
            dataclasses.replace(config, sequence_parallel=True) if self.tensor_parallel_size > 1 else config
        )
        self.mlp = build_module(
            moe_spec(hash_routed, arch.vocab_size, arch.route_scale, grouped=config.moe_grouped_gemm),
            config=moe_config,
            layer_number=layer_index + 1,
        )
        # Each TP rank runs the experts on its own tokens, so expert gradients are summed over the
        # expert-data-parallel group (which spans TP) even at EP=1; megatron marks them so only at EP>1.
        for parameter in self.mlp.experts.parameters():
            parameter.allreduce = False

    def forward(
        self,
        streams: Tensor,
        token_ids: Tensor,
        rope: dict[str, RotaryTables],
        choices: MicroChoices | None = None,
    ) -> Tensor:
        post, comb, collapsed = self.self_attention_hyper_connection(streams)
        indexer = self.self_attention.indexer
        if indexer is not None and choices is not None and choices.topk is not None:
            indexer.replay, indexer.replay_counts = choices.topk[:, :, self.csa_slot], choices.counts
        try:
            attended = self.self_attention(self.input_layernorm(collapsed), rope)
        finally:
            if indexer is not None:
                indexer.replay = indexer.replay_counts = None
        streams = expand(post, comb, attended, streams)

        post, comb, collapsed = self.mlp_hyper_connection(streams)
        mixed = self._moe(self.pre_mlp_layernorm(collapsed), token_ids, choices)
        return expand(post, comb, mixed, streams)

    def _moe(self, hidden: Tensor, token_ids: Tensor, choices: MicroChoices | None = None) -> Tensor:
        """The MoE layer on this rank's share of the tokens ([B, S, D] in and out, replicated over TP)."""
        shape = hidden.shape
        tokens, ids = hidden.reshape(-1, shape[-1]), token_ids.reshape(-1)
        pad = -tokens.shape[0] % self.tensor_parallel_size
        if self.tensor_parallel_size > 1:
            tokens = torch.nn.functional.pad(tokens, (0, 0, 0, pad))
            ids = torch.nn.functional.pad(ids, (0, pad))
            tokens = tensor_parallel.scatter_to_sequence_parallel_region(tokens)
            ids = ids.chunk(self.tensor_parallel_size)[parallel_state.get_tensor_model_parallel_rank()]
        router = self.mlp.router
        if isinstance(router, HashRouter):
            router.token_ids = ids
        elif choices is not None and choices.routes is not None:  # this rank's tokens, as the ids
            routes = choices.routes[:, : shape[1], self.layer_index].reshape(shape[0] * shape[1], -1)
            if self.tensor_parallel_size > 1:
                routes = torch.nn.functional.pad(routes, (0, 0, 0, pad), value=NO_CHOICE)
                routes = routes.chunk(self.tensor_parallel_size)[
                    parallel_state.get_tensor_model_parallel_rank()
                ]
            router.replay, router.replay_counts = routes.to(tokens.device), choices.counts
        try:
            mixed, _ = self.mlp(tokens)
        finally:
            if isinstance(router, HashRouter):
                router.token_ids = None
            else:
                router.replay = router.replay_counts = None
        if self.tensor_parallel_size > 1:
            mixed = tensor_parallel.gather_from_sequence_parallel_region(
                mixed, tensor_parallel_output_grad=False
            )
            mixed = mixed[: mixed.shape[0] - pad]
        return mixed.view(shape)


def _run_blocks(
    blocks: list[DeepseekV4Block],
    streams: Tensor,
    token_ids: Tensor,
    rope: dict[str, RotaryTables],
    choices: MicroChoices | None = None,
) -> Tensor:
    for block in blocks:
        streams = block(streams, token_ids, rope, choices)
    return streams


class DeepseekV4Decoder(MegatronModule):
    """This stage's blocks, plus the stream contraction and final norm on the last stage."""

    def __init__(self, config: TransformerConfig, arch: DeepseekV4Architecture, post_process: bool) -> None:
        super().__init__(config)
        self.offset = get_transformer_layer_offset(config)
        count = get_num_layers_to_build(config)
        self.layers = torch.nn.ModuleList(
            DeepseekV4Block(config, arch, self.offset + i) for i in range(count)
        )
        self.post_process = post_process
        if post_process:
            self.hc_head = HyperHead(config, arch.hc_mult, arch.hc_eps)
            self.final_layernorm = RMSNorm(arch.hidden_size, arch.norm_eps)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """Blocks under their global layer number in the checkpoint (local numbers in the state dict),
        so pipeline stages write disjoint keys and a checkpoint loads at another pipeline layout."""
        sharded: dict = {}
        for index, block in enumerate(self.layers):
            local = f"{prefix}layers.{index}."
            block_state = block.sharded_state_dict(local, sharded_offsets, metadata)
            apply_prefix_mapping(block_state, {local: f"{prefix}layers.{self.offset + index}."})
            sharded.update(block_state)
        tp_group = parallel_state.get_tensor_model_parallel_group()
        for name, module in self.named_children():
            if name != "layers":
                sharded.update(
                    sharded_state_dict_default(
                        module, f"{prefix}{name}.", sharded_offsets, metadata, tp_group=tp_group
                    )
                )
        return sharded

    def forward(
        self,
        streams: Tensor,
        token_ids: Tensor,
        rope: dict[str, RotaryTables],
        choices: MicroChoices | None = None,
    ) -> Tensor:
        blocks = list(self.layers)
        if self.config.recompute_granularity == "full" and torch.is_grad_enabled():
            # full recompute: keep only each chunk's input, `recompute_num_layers` blocks a chunk
            size = self.config.recompute_num_layers or 1
            for start in range(0, len(blocks), size):
                chunk = blocks[start : start + size]
                streams = cpu_compat.recompute(
                    lambda s, t, chunk=chunk: _run_blocks(chunk, s, t, rope, choices), streams, token_ids
                )
        else:
            streams = _run_blocks(blocks, streams, token_ids, rope, choices)
        if self.post_process:
            return self.final_layernorm(self.hc_head(streams))
        return streams


class DeepseekV4Model(MegatronModule):
    """One pipeline stage of DeepSeek-V4; `forward(token_ids)` gives logits [B, S, V] on the last stage,
    else the streams for the next stage in pipeline layout."""

    def __init__(
        self,
        config: TransformerConfig,
        hf_config: DeepseekV4Config,
        pre_process: bool = True,
        post_process: bool = True,
        attention: AttentionImpl = AttentionImpl.sparse,
        query_chunk: int = 256,
    ) -> None:
        super().__init__(config)
        self.model_type = ModelType.encoder_or_decoder  # what megatron's schedules ask of a model
        self.share_embeddings_and_output_weights = False  # DeepSeek-V4's head is its own tensor
        arch = DeepseekV4Architecture.from_hf(hf_config)
        self.arch = dataclasses.replace(arch, attention=AttentionImpl(attention), query_chunk=query_chunk)
        self.pre_process, self.post_process = pre_process, post_process
        self.rope = torch.nn.ModuleDict(rotary_tables(hf_config))
        vocab = padded_vocab(self.arch.vocab_size, config.tensor_model_parallel_size)
        if pre_process:
            self.embedding = MegatronModule(config)  # a container, so the vocab split is checkpointed
            self.embedding.word_embeddings = tensor_parallel.VocabParallelEmbedding(
                vocab, self.arch.hidden_size, init_method=config.init_method, config=config
            )
        self.decoder = DeepseekV4Decoder(config, self.arch, post_process)
        if post_process:
            self.output_layer = tensor_parallel.ColumnParallelLinear(
                self.arch.hidden_size,
                vocab,
                config=config,
                init_method=config.init_method,
                bias=False,
                gather_output=True,
            )
        self.input_tensor: Tensor | None = None
        mark_tensor_parallel_weights(self)

    def set_input_tensor(self, input_tensor: Tensor | list[Tensor] | None) -> None:
        """Called by megatron's pipeline schedules with the previous stage's output."""
        if isinstance(input_tensor, list):
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def to_pipeline(self, streams: Tensor) -> Tensor:
        batch, seq, n, dim = streams.shape
        return streams.permute(1, 2, 0, 3).reshape(seq * n, batch, dim).contiguous()

    def from_pipeline(self, tensor: Tensor) -> Tensor:
        total, batch, dim = tensor.shape
        n = self.arch.hc_mult
        return tensor.reshape(total // n, n, batch, dim).permute(2, 0, 1, 3)

    def forward(self, token_ids: Tensor, choices: MicroChoices | None = None) -> Tensor:
        """`choices`: the rollout's routing / indexer choices to replay (dsv4rl.train.megatron.replay)."""
        rope = dict(self.rope.items())
        if self.pre_process:
            embedded = self.embedding.word_embeddings(token_ids)
            streams = embedded.unsqueeze(2).expand(-1, -1, self.arch.hc_mult, -1).contiguous()
        else:
            if self.input_tensor is None:
                raise RuntimeError("a later pipeline stage needs set_input_tensor before forward")
            streams = self.from_pipeline(self.input_tensor)
        hidden = self.decoder(streams, token_ids, rope, choices)
        if not self.post_process:
            return self.to_pipeline(hidden)
        logits, _ = self.output_layer(hidden)
        return logits[..., : self.arch.vocab_size]
