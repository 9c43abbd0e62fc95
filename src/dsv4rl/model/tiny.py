"""The tiny DeepSeek-V4 model: transformers' DeepseekV4ForCausalLM at toy size, built from a seed.

It covers every layer type of the real model (sliding, CSA and HCA attention; hash-routed and
score-routed MoE; mHC with 4 streams) so the whole loop exercises the real architecture on a CPU.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.utils import logging as transformers_logging

from dsv4rl.config.choices import Dtype, ExpertScaleDtype
from dsv4rl.config.model_schema import LAYER_TYPES, MLP_TYPES, ModelConfig, TinyModelConfig
from dsv4rl.config.schema import QuantConfig
from dsv4rl.model.native_checkpoint import TORCH_DTYPES, load_native_model, write_native_checkpoint
from dsv4rl.model.tokenizer import load_tokenizer
from dsv4rl.model.wire_format import WireFormat


def tiny_hf_config(tiny: TinyModelConfig, vocab_size: int) -> DeepseekV4Config:
    """The transformers config for `tiny`; eager attention (the only one V4 supports)."""
    unknown = set(tiny.layer_types) - set(LAYER_TYPES)
    if unknown:
        raise ValueError(f"unknown layer_types {sorted(unknown)}; choose from {list(LAYER_TYPES)}")
    unknown = set(tiny.mlp_layer_types) - set(MLP_TYPES)
    if unknown:
        raise ValueError(f"unknown mlp_layer_types {sorted(unknown)}; choose from {list(MLP_TYPES)}")
    if len(tiny.layer_types) != tiny.num_hidden_layers or len(tiny.mlp_layer_types) != tiny.num_hidden_layers:
        raise ValueError(
            f"model.tiny.layer_types ({len(tiny.layer_types)}) and mlp_layer_types "
            f"({len(tiny.mlp_layer_types)}) must both list num_hidden_layers={tiny.num_hidden_layers} entries"
        )
    config = DeepseekV4Config(
        vocab_size=vocab_size,
        hidden_size=tiny.hidden_size,
        moe_intermediate_size=tiny.moe_intermediate_size,
        num_hidden_layers=tiny.num_hidden_layers,
        num_attention_heads=tiny.num_attention_heads,
        num_key_value_heads=1,
        head_dim=tiny.head_dim,
        qk_rope_head_dim=tiny.qk_rope_head_dim,
        q_lora_rank=tiny.q_lora_rank,
        o_groups=tiny.o_groups,
        o_lora_rank=tiny.o_lora_rank,
        n_routed_experts=tiny.n_routed_experts,
        n_shared_experts=tiny.n_shared_experts,
        num_experts_per_tok=tiny.num_experts_per_tok,
        layer_types=list(tiny.layer_types),
        mlp_layer_types=list(tiny.mlp_layer_types),
        compress_rates={
            "compressed_sparse_attention": tiny.csa_compress_rate,
            "heavily_compressed_attention": tiny.hca_compress_rate,
        },
        sliding_window=tiny.sliding_window,
        index_n_heads=tiny.index_n_heads,
        index_head_dim=tiny.index_head_dim,
        index_topk=tiny.index_topk,
        hc_mult=tiny.hc_mult,
        hc_sinkhorn_iters=tiny.hc_sinkhorn_iters,
        max_position_embeddings=tiny.max_position_embeddings,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    config._attn_implementation = "eager"
    return config


@torch.no_grad()
def randomize_hash_routing(model: DeepseekV4ForCausalLM, generator: torch.Generator) -> None:
    """HF starts tid2eid at zeros (every token -> expert 0): give each token k distinct experts."""
    config = model.config
    for layer in model.model.layers:
        table = getattr(layer.mlp.gate, "tid2eid", None)
        if table is None:
            continue
        scores = torch.rand(config.vocab_size, config.n_routed_experts, generator=generator)
        table.copy_(scores.topk(config.num_experts_per_tok, dim=-1).indices.to(table.dtype))


def build_tiny_model(model_config: ModelConfig, vocab_size: int) -> DeepseekV4ForCausalLM:
    """Random init from `model_config.init_seed`, fp32, with a real hash-routing table."""
    config = tiny_hf_config(model_config.tiny, vocab_size)
    generator = torch.Generator().manual_seed(model_config.init_seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(model_config.init_seed)
        model = DeepseekV4ForCausalLM(config)
    randomize_hash_routing(model, generator)
    return model.to(torch.float32).eval()


def load_model(model_config: ModelConfig, vocab_size: int | None = None) -> DeepseekV4ForCausalLM:
    """The tiny model from its seed, or the checkpoint at `model_config.path` (native or transformers)."""
    if model_config.path is None:
        if vocab_size is None:
            vocab_size = len(load_tokenizer(model_config))
        return build_tiny_model(model_config, vocab_size)
    return load_native_model(model_config.path, TORCH_DTYPES[Dtype(model_config.dtype)])


def checkpoint_wire_format(quant: QuantConfig) -> WireFormat:
    """The format a checkpoint of `quant` is written in (expert scales E8M0, like the release, unless set)."""
    scale = torch.float32 if quant.expert_scale_dtype == ExpertScaleDtype.float32 else torch.float8_e8m0fnu
    return WireFormat(quant.name, tuple(quant.block_size), scale)


def write_tiny_model(model_config: ModelConfig, directory: Path, quant: QuantConfig) -> None:
    """Build the tiny model from its seed into `directory`: a native checkpoint in `quant`'s format and
    the tokenizer (`dsv4rl.model.model_dir` adds the manifest of the settings it was built from)."""
    tokenizer = load_tokenizer(model_config)
    model = load_model(model_config, vocab_size=len(tokenizer))
    transformers_logging.disable_progress_bar()  # the supervisor's own display is on screen
    write_native_checkpoint(model, directory, checkpoint_wire_format(quant))
    tokenizer.save_pretrained(directory)
