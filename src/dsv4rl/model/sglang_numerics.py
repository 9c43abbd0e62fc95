"""SGLang 0.5.23's rounding points, installed on transformers' DeepSeek-V4 model (`engine.numerics=sglang`).

The reference engine runs transformers' model in float32. `apply_sglang_numerics` makes the same model
compute with the numbers SGLang's kernels produce, one named feature (`NumericsFeature`) at a time, so
each one can be switched on alone and its share of the train-vs-rollout gap measured:

- `bf16_activations`: bf16 tensors at module boundaries (projection and norm outputs, q, the block input
  and the residual streams after every mHC mix, attention and MoE outputs), float32 inside norms, RoPE,
  softmax, Sinkhorn and the mHC post/comb mix, and float32 compressor projections;
- `kv_fp8`: the FP8 KV cache (sliding-window keys and compressed entries);
- `act_fp8`: dynamic FP8 inputs of the FP8 linears (and of FP8 routed experts);
- `mhc_tf32`: the TF32 mHC mixing projection;
- `router_bf16_input`: the router's fp32 logits from bf16 hidden states;
- `bf16_logits`: a bf16 LM head output (off when the engine runs with `--enable-fp32-lm-head`);
- `bf16_weights`: the weights SGLang holds, bf16 where the release keeps bf16 (applied to the engine's
  weights as they are loaded, `served_weight`, not here).

The same installer serves the trainer (`train.numerics.*`) with straight-through rounding: forward values
as SGLang's, gradients as if nothing were rounded. Which kernel each point follows: `docs/numerics.md`.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from dsv4rl.config.choices import NumericsFeature, QuantMode
from dsv4rl.config.schema import Config
from dsv4rl.model.naming import CheckpointKind, checkpoint_kind, hf_to_native
from dsv4rl.model.sglang_rounding import (
    fp8_activation,
    fp8_kv_entry,
    round_bf16,
    round_tf32,
    straight_through,
)
from dsv4rl.model.sinkhorn import sinkhorn_rounds

__all__ = [
    "FP8_LINEAR_SUFFIXES",
    "TRAINER_FEATURES",
    "InstalledNumerics",
    "apply_sglang_numerics",
    "apply_trainer_numerics",
    "served_weight",
    "sglang_features",
    "trainer_numerics",
]

# transformers module names of the linears the release stores in FP8 (dsv4rl.model.naming's fp8_linear)
FP8_LINEAR_SUFFIXES = (
    "self_attn.q_a_proj",
    "self_attn.q_b_proj",
    "self_attn.kv_proj",
    "self_attn.o_a_proj",
    "self_attn.o_b_proj",
    "self_attn.compressor.indexer.q_b_proj",
    "mlp.shared_experts.gate_proj",
    "mlp.shared_experts.up_proj",
    "mlp.shared_experts.down_proj",
)
# Compressor and indexer projections: bf16 x bf16 -> fp32 GEMM in SGLang (compressor.py:160-166), unrounded.
_FP32_OUTPUT_SUFFIXES = ("compressor.kv_proj", "compressor.gate_proj", "indexer.kv_proj", "indexer.gate_proj")
# Norms whose output is a bf16 tensor in SGLang; the kv norms feed RoPE and the cache store in fp32.
_BF16_NORM_SUFFIXES = ("input_layernorm", "post_attention_layernorm", "self_attn.q_a_norm")


def sglang_features(fp8_checkpoint: bool, fp32_lm_head: bool) -> frozenset[NumericsFeature]:
    """Every rounding point SGLang applies to this checkpoint: FP8 activations only when the linears are
    FP8, bf16 logits unless the engine was started with `--enable-fp32-lm-head`."""
    features = set(NumericsFeature)
    if not fp8_checkpoint:
        features.discard(NumericsFeature.act_fp8)
    if fp32_lm_head:
        features.discard(NumericsFeature.bf16_logits)
    return frozenset(features)


def served_weight(native_name: str, tensor: Tensor) -> Tensor:
    """The values SGLang holds for a checkpoint tensor: bf16 for what the release keeps in bf16 (norms,
    router, embedding, head, compressor and indexer projections; FP8 and MXFP4 values are exact in bf16),
    float32 for mHC, sinks, position biases and the router bias (`dsv4rl.model.naming.CheckpointKind`)."""
    kind = checkpoint_kind(native_name)
    if kind in (CheckpointKind.fp32, CheckpointKind.integer) or not tensor.is_floating_point():
        return tensor
    return round_bf16(tensor)


# train.numerics.<name> -> the rounding point it installs in the trainer (each named as the engine's)
TRAINER_FEATURES = (
    NumericsFeature.kv_fp8,
    NumericsFeature.act_fp8,
    NumericsFeature.bf16_weights,
    NumericsFeature.bf16_activations,
    NumericsFeature.mhc_tf32,
    NumericsFeature.router_bf16_input,
)


def trainer_numerics(model: nn.Module, cfg: Config) -> InstalledNumerics | None:
    """`train.numerics.*` on the trainer's model: the KV cache and the FP8 linears' inputs fake-quantized
    with SGLang's scale rules, and the bf16 points a bf16 trainer has anyway (forward: SGLang's values;
    backward: identity). None when all are off."""
    features = {f for f in TRAINER_FEATURES if getattr(cfg.train.numerics, f.value)}
    if not features:
        return None
    return apply_trainer_numerics(model, features, cfg.quant.name)


def apply_trainer_numerics(
    model: nn.Module, features: Iterable[NumericsFeature], quant: QuantMode
) -> InstalledNumerics:
    """`apply_sglang_numerics` plus, for `bf16_weights`, the weights SGLang holds in bf16 rounded for the
    forward (`served_weight`'s rule; with an FP8 checkpoint only the tensors it keeps in bf16)."""
    chosen = frozenset(features)
    installed = apply_sglang_numerics(
        model, chosen - {NumericsFeature.bf16_weights}, fp8_experts=quant == QuantMode.fp8_rollout
    )
    if NumericsFeature.bf16_weights in chosen:
        _hook_bf16_weights(installed, model, QuantMode(quant).quantized)
    return InstalledNumerics(chosen, installed.handles, installed.replaced)


def _held_in_bf16(hf_name: str, tensor: Tensor, quantized: bool) -> bool:
    """Whether the engine holds this trainer tensor in bf16 (fp32 kinds stay; FP8/MXFP4 tensors of a
    quantized checkpoint hold their quantized values, not bf16 roundings of the trainer's)."""
    if not tensor.is_floating_point():
        return False
    kinds = {checkpoint_kind(native) for native, _ in hf_to_native(hf_name, tensor)}
    if kinds & {CheckpointKind.fp32, CheckpointKind.integer}:
        return False
    return not (quantized and kinds & {CheckpointKind.fp8_linear, CheckpointKind.routed_expert})


def _hook_bf16_weights(installed: InstalledNumerics, model: nn.Module, quantized: bool) -> None:
    """Round each module's bf16-held parameters in place for its forward and restore them after: the
    forward computes with SGLang's weights, autograd's weight gradients are the straight-through ones."""
    owners: dict[str, list[str]] = {}
    for name, param in model.named_parameters():
        if _held_in_bf16(name, param, quantized):
            module_name, _, attr = name.rpartition(".")
            owners.setdefault(module_name, []).append(attr)
    for module_name, attrs in owners.items():
        module = model.get_submodule(module_name)
        kept: list[Tensor] = []

        def pre(mod: nn.Module, _args: tuple, attrs=attrs, kept=kept) -> None:
            for attr in attrs:
                param = mod._parameters[attr]
                kept.append(param.data)
                param.data = round_bf16(param.data)

        def post(mod: nn.Module, _args: tuple, _out: object, attrs=attrs, kept=kept) -> None:
            for attr, data in zip(attrs, kept, strict=True):
                mod._parameters[attr].data = data
            kept.clear()

        installed.handles.append(module.register_forward_pre_hook(pre))
        installed.handles.append(module.register_forward_hook(post))


@dataclass
class InstalledNumerics:
    """The hooks and replaced forwards on one model; `remove()` restores transformers' own."""

    features: frozenset[NumericsFeature]
    handles: list = field(default_factory=list)
    replaced: list[tuple[nn.Module, str]] = field(default_factory=list)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        for module, name in self.replaced:
            module.__dict__.pop(name, None)
        self.handles.clear()
        self.replaced.clear()


def _identity(x: Tensor) -> Tensor:
    return x


@dataclass(frozen=True)
class _Rules:
    """The rounding functions of one feature set (straight-through, so the trainer can backpropagate)."""

    act: Callable[[Tensor], Tensor]  # a bf16 module boundary
    kv: Callable[[Tensor], Tensor]  # a KV cache entry as stored and read back
    fp8_input: Callable[[Tensor], Tensor]  # the input of an FP8 GEMM
    tf32_mix: bool

    @classmethod
    def of(cls, features: frozenset[NumericsFeature], rope_dim: int) -> _Rules:
        bf16 = NumericsFeature.bf16_activations in features
        act = straight_through(round_bf16) if bf16 else _identity
        if NumericsFeature.kv_fp8 in features:
            kv = straight_through(lambda x: fp8_kv_entry(x, rope_dim))
        else:
            kv = act  # a bf16 cache with bf16 activations, else untouched
        fp8 = straight_through(fp8_activation) if NumericsFeature.act_fp8 in features else act
        return cls(act, kv, fp8, NumericsFeature.mhc_tf32 in features)


def apply_sglang_numerics(
    model: nn.Module, features: Iterable[NumericsFeature | str], *, fp8_experts: bool = False
) -> InstalledNumerics:
    """Install `features` on a transformers DeepseekV4ForCausalLM (before FSDP wraps it).

    `fp8_experts`: the routed experts are FP8 too (quant=fp8_rollout), so `act_fp8` quantizes their inputs;
    MXFP4 experts run W4A16 on Hopper (`layers/quantization/fp8.py:459-466`): bf16 activations, and
    dequantize-then-bf16 weights, which is what `served_weight` holds."""
    chosen = frozenset(NumericsFeature(f) for f in features)
    installed = InstalledNumerics(chosen)
    rules = _Rules.of(chosen, model.config.qk_rope_head_dim)
    bf16 = NumericsFeature.bf16_activations in chosen
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            _hook_linear(installed, name, module, chosen, rules)
        elif bf16 and _bf16_output(name, module):
            _post(installed, module, lambda out, r=rules: r.act(out))
        elif isinstance(module, hf.DeepseekV4Attention) and (bf16 or NumericsFeature.kv_fp8 in chosen):
            _replace(installed, module, "forward", _attention_forward(rules))
        elif isinstance(module, hf.DeepseekV4CSACompressor | hf.DeepseekV4HCACompressor) and (
            rules.kv is not _identity
        ):
            _post(installed, module, lambda out, r=rules: (r.kv(out[0]), *out[1:]))
        elif isinstance(module, hf.DeepseekV4HyperConnection) and (bf16 or rules.tf32_mix):
            # also dsv4rl.model.sinkhorn's subclass: this forward runs its remaining rounds the same way
            _replace(installed, module, "forward", _hyper_connection_forward(rules))
        elif isinstance(module, hf.DeepseekV4DecoderLayer) and bf16:
            _replace(installed, module, "forward", _decoder_layer_forward(rules))
        elif isinstance(module, hf.DeepseekV4TopKRouter | hf.DeepseekV4HashRouter):
            if NumericsFeature.router_bf16_input in chosen:
                # deepseek_v2.py:575-600: bf16 hidden x bf16 weight -> fp32 logits (linear_bf16_fp32)
                installed.handles.append(module.register_forward_pre_hook(_round_hidden, with_kwargs=True))
        elif isinstance(module, hf.DeepseekV4Experts):
            _hook_experts(installed, module, rules, fp8=fp8_experts and NumericsFeature.act_fp8 in chosen)
    return installed


def _bf16_output(name: str, module: nn.Module) -> bool:
    """Modules whose output SGLang holds in bf16 (linears and attention aside): the embedding, the norms
    feeding a GEMM, the MoE block (routed + shared sum)."""
    if isinstance(module, nn.Embedding | hf.DeepseekV4SparseMoeBlock):
        return True
    return isinstance(module, hf.DeepseekV4RMSNorm) and (
        name.endswith(_BF16_NORM_SUFFIXES) or name == "model.norm"
    )


# ------------------------------------------------------------------------------------------ hooks
def _post(installed: InstalledNumerics, module: nn.Module, fn: Callable) -> None:
    installed.handles.append(module.register_forward_hook(lambda _m, _args, out: fn(out)))


def _replace(installed: InstalledNumerics, module: nn.Module, name: str, fn: Callable) -> None:
    setattr(module, name, types.MethodType(fn, module))
    installed.replaced.append((module, name))


def _round_hidden(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The router's `hidden_states` (first argument, or keyword) in bf16."""
    rounding = straight_through(round_bf16)
    if args:
        return (rounding(args[0]), *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": rounding(kwargs["hidden_states"])}


def _hook_linear(
    installed: InstalledNumerics,
    name: str,
    module: nn.Linear,
    features: frozenset[NumericsFeature],
    rules: _Rules,
) -> None:
    if name == "lm_head":
        # logits_processor.py:1198-1201: bf16 hidden x bf16 head -> bf16 logits, cast to fp32 afterwards
        if NumericsFeature.bf16_logits in features:
            _post(installed, module, lambda out: straight_through(round_bf16)(out))
        return
    if name.endswith(_FP32_OUTPUT_SUFFIXES):
        return
    pre = rules.fp8_input if name.endswith(FP8_LINEAR_SUFFIXES) else rules.act
    if pre is _identity:
        return
    installed.handles.append(module.register_forward_pre_hook(lambda _m, args: (pre(args[0]), *args[1:])))
    if NumericsFeature.bf16_activations in features:
        _post(installed, module, rules.act)


def _hook_experts(installed: InstalledNumerics, module: nn.Module, rules: _Rules, fp8: bool) -> None:
    """MXFP4 experts: bf16 in, SwiGLU output bf16 into the down GEMM, bf16 out (W4A16). FP8 experts:
    both GEMM inputs quantized per (token, 128) (silu_and_mul_masked_post_quant.cuh)."""
    rule = rules.fp8_input if fp8 else rules.act
    if rule is _identity:
        return
    installed.handles.append(module.register_forward_pre_hook(lambda _m, args: (rule(args[0]), *args[1:])))
    gate = module._apply_gate
    _replace(installed, module, "_apply_gate", lambda self, gate_up: rule(gate(gate_up)))
    _post(installed, module, rules.act)


# ------------------------------------------------------------------------------------------ forwards
def _attention_forward(rules: _Rules) -> Callable:
    """transformers' DeepseekV4Attention.forward with SGLang's rounding: q in bf16 after the fused
    norm+RoPE (`fused_q_norm_rope`), the kv entry as the cache stores it (`main_norm_rope.cuh:415-437`),
    the attention output in bf16 (FlashMLA), fp32 scores and softmax."""

    def forward(
        self: hf.DeepseekV4Attention,
        hidden_states: Tensor,
        position_embeddings: dict,
        position_ids: Tensor,
        attention_mask: Tensor | None,
        past_key_values=None,
        **kwargs,
    ) -> tuple[Tensor, Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        cos, sin = position_embeddings[self.rope_layer_type]
        q_residual = self.q_a_norm(self.q_a_proj(hidden_states))
        q = self.q_b_proj(q_residual).view(*hidden_shape).transpose(1, 2)
        q = rules.act(hf.apply_rotary_pos_emb(self.q_b_norm(q), cos, sin))
        kv = self.kv_norm(self.kv_proj(hidden_states)).view(*hidden_shape).transpose(1, 2)
        kv = rules.kv(hf.apply_rotary_pos_emb(kv, cos, sin))
        if past_key_values is not None:
            kv = past_key_values.update(kv, kv, self.layer_idx)[0]
        block_bias = None
        if self.compressor is not None:
            compressed_kv, block_bias = self.compressor(
                hidden_states, q_residual, position_ids, past_key_values, self.layer_idx
            )
            kv = torch.cat([kv, compressed_kv], dim=2)
        if isinstance(attention_mask, Tensor) and kv.shape[2] > attention_mask.shape[-1]:
            if block_bias is not None:
                attention_mask = torch.cat([attention_mask, block_bias.to(attention_mask.dtype)], dim=-1)
            else:
                attention_mask = F.pad(attention_mask, (0, kv.shape[2] - attention_mask.shape[-1]), value=0.0)
        interface = hf.ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, hf.eager_attention_forward
        )
        attn_output, attn_weights = interface(
            self, q, kv, kv, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling, sliding_window=self.sliding_window, s_aux=self.sinks, **kwargs,
        )  # fmt: skip
        attn_output = rules.act(attn_output)
        attn_output = hf.apply_rotary_pos_emb(attn_output.transpose(1, 2), cos, -sin).transpose(1, 2)
        grouped = rules.act(attn_output).reshape(*input_shape, self.config.o_groups, -1)
        grouped = self.o_a_proj(grouped).flatten(2)
        return self.o_b_proj(grouped), attn_weights

    return forward


def _hyper_connection_forward(rules: _Rules) -> Callable:
    """transformers' DeepseekV4HyperConnection.forward, with the mixing projection as SGLang's
    `tf32_hc_prenorm_gemm` computes it (`kernels/ops/layernorm/mhc.py:1118-1140`): x . TF32(fn) on the
    un-normed bf16 streams, then divided by their RMS; pre/post/comb and Sinkhorn in fp32; the block input
    sum_i pre_i x_i in fp32 and rounded once to bf16."""

    def forward(self: hf.DeepseekV4HyperConnection, hidden_streams: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        batch_size, seq_len = hidden_streams.shape[:2]
        hc = self.hc_mult
        flat = hidden_streams.view(batch_size, seq_len, -1).float()
        if rules.tf32_mix:
            inv_rms = torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.input_norm.eps)
            mixes = F.linear(
                straight_through(round_tf32)(flat), straight_through(round_tf32)(self.fn.float())
            )
            mixes = mixes * inv_rms
        else:
            mixes = F.linear(self.input_norm(flat), self.fn.float())
        pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.split([hc, hc, hc * hc])
        pre_scale, post_scale, comb_scale = self.scale.unbind(0)
        comb_w = comb_w.view(*comb_w.shape[:-1], hc, hc)
        pre = torch.sigmoid(pre_w * pre_scale + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_scale + post_b)
        comb = torch.softmax(comb_w * comb_scale + comb_b.view(hc, hc), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        # the rounds left after the first column normalisation (dsv4rl.model.sinkhorn keeps the fast
        # module's count in `sinkhorn_rounds_left`; a plain transformers module in hc_sinkhorn_iters)
        rounds = getattr(self, "sinkhorn_rounds_left", self.hc_sinkhorn_iters - 1)
        comb = sinkhorn_rounds(comb, rounds, self.hc_eps)
        collapsed = rules.act((pre.unsqueeze(-1) * hidden_streams.float()).sum(dim=2)).to(
            hidden_streams.dtype
        )
        return post, comb, collapsed

    return forward


def _decoder_layer_forward(rules: _Rules) -> Callable:
    """transformers' DeepseekV4DecoderLayer.forward with the post/comb mix in fp32 and the new residual
    streams rounded once to bf16, as SGLang's mHC post kernel does (`mhc.py:1272-1328`)."""

    def forward(self: hf.DeepseekV4DecoderLayer, hidden_states: Tensor, input_ids=None, **kwargs) -> Tensor:
        dtype = hidden_states.dtype
        post, comb, collapsed = self.attn_hc(hidden_states)
        attn_output, _ = self.self_attn(self.input_layernorm(collapsed), **kwargs)
        hidden_states = _mix(post, comb, attn_output, hidden_states, rules).to(dtype)
        post, comb, collapsed = self.ffn_hc(hidden_states)
        mlp_output = self.mlp(self.post_attention_layernorm(collapsed), input_ids=input_ids)
        return _mix(post, comb, mlp_output, hidden_states, rules).to(dtype)

    return forward


def _mix(post: Tensor, comb: Tensor, output: Tensor, streams: Tensor, rules: _Rules) -> Tensor:
    """X' = post * y + comb^T X in fp32, one rounding."""
    mixed = post.float().unsqueeze(-1) * output.float().unsqueeze(-2) + torch.matmul(
        comb.float().transpose(-1, -2), streams.float()
    )
    return rules.act(mixed)
