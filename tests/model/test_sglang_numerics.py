"""SGLang's rounding points installed on the tiny transformers model: each one where SGLang rounds, and only
there; removable; straight-through in training."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from dsv4rl.config.choices import NumericsFeature
from dsv4rl.config.model_schema import ModelConfig, TinyModelConfig
from dsv4rl.model.sglang_numerics import apply_sglang_numerics, served_weight, sglang_features
from dsv4rl.model.sglang_rounding import fp8_activation, fp8_kv_entry, round_bf16, round_tf32
from dsv4rl.model.sinkhorn import use_fast_sinkhorn
from dsv4rl.model.tiny import build_tiny_model

F = NumericsFeature
VOCAB = 24


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    model = build_tiny_model(ModelConfig(tiny=TinyModelConfig(index_topk=4, index_n_heads=8)), VOCAB)
    use_fast_sinkhorn(model)  # as the engine and the trainer load it
    return model


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))


def logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=ids, use_cache=False).logits, dim=-1)


def on_grid(x: torch.Tensor, rule) -> bool:
    return bool(torch.equal(rule(x), x))


def capture(module: torch.nn.Module, inputs: bool = False) -> tuple[list, object]:
    """Record a module's first input (or output) as later hooks see it: after the installed rounding."""
    seen: list = []
    if inputs:
        handle = module.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach().clone()))
    else:
        handle = module.register_forward_hook(lambda _m, _a, out: seen.append(out))
    return seen, handle


@pytest.mark.parametrize("feature", [f for f in F if f != F.bf16_weights])
def test_each_feature_changes_the_output_and_comes_off(model, ids, feature: NumericsFeature) -> None:
    exact = logprobs(model, ids)
    installed = apply_sglang_numerics(model, [feature])
    try:
        rounded = logprobs(model, ids)
    finally:
        installed.remove()
    assert (rounded - exact).abs().max() > 1e-6, f"{feature} changes nothing"
    assert torch.equal(logprobs(model, ids), exact)


def test_kv_fp8_stores_sliding_and_compressed_entries_on_sglangs_grid(model, ids) -> None:
    rope = model.config.qk_rope_head_dim
    entry = lambda x: fp8_kv_entry(x, rope)  # noqa: E731
    compressor = model.model.layers[1].self_attn.compressor
    for features, expect in (([F.kv_fp8], True), ([], False)):
        installed = apply_sglang_numerics(model, features)
        seen, handle = capture(compressor)
        cache = DynamicCache(config=model.config)
        try:
            with torch.no_grad():
                model(input_ids=ids, past_key_values=cache, use_cache=True)
        finally:
            handle.remove()
            installed.remove()
        sliding = cache.layers[0].keys
        assert on_grid(sliding, entry) == expect
        assert on_grid(seen[0][0], entry) == expect  # the compressed entries attention reads
    # and the rounding is SGLang's, not any FP8: nope values are multiples of a power of two per 64 dims
    x = torch.randn(3, 80)
    assert torch.equal(fp8_kv_entry(x, 16)[:, 64:], round_bf16(x[:, 64:]))


def test_act_fp8_quantizes_the_fp8_linears_inputs_only(model, ids) -> None:
    attn, shared = model.model.layers[1].self_attn, model.model.layers[1].mlp.shared_experts
    installed = apply_sglang_numerics(model, [F.act_fp8])
    seen = [
        capture(module, inputs=True) for module in (attn.q_a_proj, shared.down_proj, attn.compressor.kv_proj)
    ]
    try:
        logprobs(model, ids)
    finally:
        installed.remove()
        for _, handle in seen:
            handle.remove()
    (q_input, _), (shared_input, _), (compressor_input, _) = seen
    assert on_grid(q_input[0], fp8_activation) and on_grid(shared_input[0], fp8_activation)
    assert not on_grid(compressor_input[0], fp8_activation)  # compressor projections are bf16 GEMMs in SGLang


def test_bf16_activations_round_module_boundaries_not_the_fp32_insides(model, ids) -> None:
    layer = model.model.layers[1]
    installed = apply_sglang_numerics(model, [F.bf16_activations])
    modules = {
        "layer": layer,
        "q_norm": layer.self_attn.q_a_norm,
        "moe": layer.mlp,
        "compressor_kv": layer.self_attn.compressor.kv_proj,
        "kv_norm": layer.self_attn.kv_norm,
    }
    outputs = {name: capture(module) for name, module in modules.items()}
    try:
        logprobs(model, ids)
    finally:
        installed.remove()
        for _, handle in outputs.values():
            handle.remove()
    for name in ("layer", "q_norm", "moe"):
        assert on_grid(outputs[name][0][0], round_bf16), name
    # fp32 GEMM output (compressor.py:160-166) and the kv norm feeding the fused rope + cache store
    assert not on_grid(outputs["compressor_kv"][0][0], round_bf16)
    assert not on_grid(outputs["kv_norm"][0][0], round_bf16)


def test_bf16_logits_and_router_input(model, ids) -> None:
    gate = model.model.layers[1].mlp.gate
    installed = apply_sglang_numerics(model, [F.bf16_logits, F.router_bf16_input])
    seen, handle = capture(gate, inputs=True)
    try:
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits
    finally:
        installed.remove()
        handle.remove()
    assert on_grid(logits, round_bf16)
    assert on_grid(seen[0], round_bf16)
    with torch.no_grad():
        assert not on_grid(model(input_ids=ids, use_cache=False).logits, round_bf16)


def test_mhc_tf32_ignores_the_low_bits_of_the_mixing_weight(model, ids) -> None:
    """With TF32 operands, moving fn within its TF32 cell changes nothing; exact fp32 notices."""
    hc = model.model.layers[0].attn_hc
    streams = torch.randn(2, 5, 4, model.config.hidden_size).round(decimals=2).bfloat16().float()
    saved = hc.fn.detach().clone()
    installed = apply_sglang_numerics(model, [F.mhc_tf32])
    try:
        with torch.no_grad():
            hc.fn.copy_(round_tf32(saved))
            low = hc(streams)
            hc.fn.copy_(saved)  # the same TF32 values, other low bits
            high = hc(streams)
    finally:
        installed.remove()
    with torch.no_grad():
        exact_high = hc(streams)
        hc.fn.copy_(round_tf32(saved))
        exact_low = hc(streams)
        hc.fn.copy_(saved)
    assert not torch.equal(round_tf32(saved), saved)
    for a, b in zip(low, high, strict=True):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(exact_low, exact_high, strict=True))


def test_straight_through_training_gradients(model, ids) -> None:
    """kv_fp8 + act_fp8 in the trainer: SGLang's forward values, gradients close to the exact ones."""

    def grads() -> tuple[torch.Tensor, float]:
        model.zero_grad()
        model.requires_grad_(True)
        logits = model(input_ids=ids, use_cache=False).logits
        loss = torch.log_softmax(logits, -1)[..., 5].mean()
        loss.backward()
        grad = model.model.layers[1].self_attn.q_a_proj.weight.grad.clone()
        model.requires_grad_(False)
        return grad, float(loss.detach())

    exact, exact_loss = grads()
    installed = apply_sglang_numerics(model, [F.kv_fp8, F.act_fp8])
    try:
        rounded, rounded_loss = grads()
    finally:
        installed.remove()
        model.zero_grad()
    assert rounded_loss != exact_loss
    assert torch.isfinite(rounded).all() and rounded.abs().sum() > 0
    assert (rounded - exact).norm() < 0.2 * exact.norm()


def test_features_follow_the_checkpoint_and_the_lm_head_flag() -> None:
    assert sglang_features(fp8_checkpoint=True, fp32_lm_head=False) == frozenset(F)
    assert F.act_fp8 not in sglang_features(fp8_checkpoint=False, fp32_lm_head=False)
    assert F.bf16_logits not in sglang_features(fp8_checkpoint=True, fp32_lm_head=True)


def test_served_weight_is_bf16_where_the_release_keeps_bf16() -> None:
    x = torch.tensor([1 + 2**-10, 3.0])
    for name in (
        "layers.0.attn_norm.weight",
        "layers.1.ffn.gate.weight",
        "head.weight",
        "layers.0.attn.wq_a.weight",
    ):
        assert torch.equal(served_weight(name, x), round_bf16(x)), name
    for name in ("layers.0.hc_attn_fn", "layers.0.attn.attn_sink", "layers.1.ffn.gate.bias"):
        assert torch.equal(served_weight(name, x), x), name
