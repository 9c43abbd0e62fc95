"""Parameter counts of a full-size DeepSeek-V4 model from the recipe's `model.*` facts, and the bytes of
each weight format.

The routed experts are counted from the shapes (experts x 3 matrices w1/w2/w3 of hidden x
moe_intermediate per layer: 277.0 B for DeepSeek-V4-Flash, its published count); embedding and head are
vocab x hidden each (not tied); what is left of `total_params_b` is the dense part of the layers
(attention, compressors, indexer, router, shared expert, norms, mHC), spread evenly over the layers. The
MTP block is not in the total and not counted. DeepSeek-V4.1's Engram tables (`model.engram_params_b`) are
not in the total either: they stay frozen, in FP8 as released (one E8M0 scale per 32 values), and are
never pushed.

Weight formats (the engines hold what `quant` sends, see the README's table): FP8 e4m3 is one byte a
value plus one scale per 128x128 tile (counted at 4 bytes, the widest scale dtype); MXFP4 half a byte plus
one E8M0 byte per 32 values; embedding and head stay BF16. The layers' BF16 tensors in the FP8 formats
(norms, compressors, router: under a tenth of a layer's dense part) are counted as FP8.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv4rl.config.choices import Dtype, QuantMode
from dsv4rl.config.schema import Config

SHAPE_KEYS = (
    "total_params_b",
    "active_params_b",
    "num_hidden_layers",
    "n_routed_experts",
    "hidden_size",
    "vocab_size",
    "num_attention_heads",
    "head_dim",
    "moe_intermediate_size",
    "num_experts_per_tok",
    "n_shared_experts",
    "hc_mult",
)
DTYPE_BYTES = {Dtype.float32: 4, Dtype.bfloat16: 2}
FP8_TILE = 128 * 128
MXFP4_BLOCK = 32
ENGRAM_BYTES = 1 + 1 / 32  # an FP8 value and its share of the row's E8M0 scale per 32 (264 B a 256-wide row)


@dataclass(frozen=True)
class ModelShape:
    total_params: float
    active_params: float
    layers: int
    routed_experts: int
    hidden: int
    vocab: int
    heads: int
    head_dim: int
    moe_intermediate: int
    experts_per_token: int
    shared_experts: int
    hc_mult: int
    compress_ratios: tuple[int, ...] | None = None  # the backbone's; None: DeepSeek-V4's release pattern
    frozen_params: float = 0.0  # held frozen and never pushed (Engram)

    @property
    def expert_params_per_layer(self) -> float:
        return self.routed_experts * 3 * self.hidden * self.moe_intermediate

    @property
    def embedding_params(self) -> float:
        """The embedding; the head has as many."""
        return self.vocab * self.hidden

    @property
    def dense_params_per_layer(self) -> float:
        experts = self.layers * self.expert_params_per_layer
        return (self.total_params - experts - 2 * self.embedding_params) / self.layers


def missing_shape_keys(cfg: Config) -> list[str]:
    return [f"model.{key}" for key in SHAPE_KEYS if getattr(cfg.model, key) is None]


def model_shape(cfg: Config) -> ModelShape | None:
    """The recipe's full-size model, or None when a fact is missing (the tiny model states none)."""
    if missing_shape_keys(cfg):
        return None
    m = cfg.model
    return ModelShape(
        total_params=m.total_params_b * 1e9,  # type: ignore[operator]
        active_params=m.active_params_b * 1e9,  # type: ignore[operator]
        layers=m.num_hidden_layers,  # type: ignore[arg-type]
        routed_experts=m.n_routed_experts,  # type: ignore[arg-type]
        hidden=m.hidden_size,  # type: ignore[arg-type]
        vocab=m.vocab_size,  # type: ignore[arg-type]
        heads=m.num_attention_heads,  # type: ignore[arg-type]
        head_dim=m.head_dim,  # type: ignore[arg-type]
        moe_intermediate=m.moe_intermediate_size,  # type: ignore[arg-type]
        experts_per_token=m.num_experts_per_tok,  # type: ignore[arg-type]
        shared_experts=m.n_shared_experts,  # type: ignore[arg-type]
        hc_mult=m.hc_mult,  # type: ignore[arg-type]
        compress_ratios=tuple(m.compress_ratios) if m.compress_ratios is not None else None,
        frozen_params=(m.engram_params_b or 0.0) * 1e9,
    )


@dataclass(frozen=True)
class StageParams:
    """The parameters of one pipeline stage: dense (its layers' dense part, the embedding on the first
    stage, the head on the last) and routed experts."""

    stage: int
    layers: int
    dense: float
    experts: float


def stage_params(shape: ModelShape, layers_per_stage: list[int]) -> list[StageParams]:
    last = len(layers_per_stage) - 1
    stages = []
    for stage, layers in enumerate(layers_per_stage):
        ends = (stage == 0) + (stage == last)  # embedding and/or head
        dense = layers * shape.dense_params_per_layer + ends * shape.embedding_params
        stages.append(StageParams(stage, layers, dense, layers * shape.expert_params_per_layer))
    return stages


@dataclass(frozen=True)
class FormatBytes:
    """Bytes per parameter of a weight format, by tensor class."""

    experts: float
    dense: float  # the layers' linears
    embedding: float  # embedding and head


def format_bytes(quant: QuantMode, model_dtype: Dtype) -> FormatBytes:
    """What the trainer sends and the engines hold for `quant` (scales included)."""
    fp8 = 1 + 4 / FP8_TILE
    if quant == QuantMode.fp8_rollout:
        return FormatBytes(experts=fp8, dense=fp8, embedding=2)
    if quant == QuantMode.fp8_mxfp4:
        return FormatBytes(experts=0.5 + 1 / MXFP4_BLOCK, dense=fp8, embedding=2)
    width = 2 if quant == QuantMode.bf16 else DTYPE_BYTES[model_dtype]
    return FormatBytes(experts=width, dense=width, embedding=width)


def model_bytes(shape: ModelShape, fmt: FormatBytes) -> float:
    """The whole model in `fmt`: what one weight sync puts on the wire."""
    return (
        shape.layers
        * (shape.expert_params_per_layer * fmt.experts + shape.dense_params_per_layer * fmt.dense)
        + 2 * shape.embedding_params * fmt.embedding
    )
