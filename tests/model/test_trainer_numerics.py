"""`train.numerics.bf16_weights` and the other bf16 points in the trainer: the forward computes with the
weights SGLang holds in bf16 (fp32 kinds untouched), the trainer's float32 weights are back after each
forward, and gradients flow (straight-through)."""

from __future__ import annotations

import torch

from dsv4rl.config.choices import NumericsFeature, QuantMode
from dsv4rl.config.model_schema import ModelConfig, TinyModelConfig
from dsv4rl.model.naming import hf_to_native
from dsv4rl.model.sglang_numerics import apply_trainer_numerics, served_weight
from dsv4rl.model.tiny import build_tiny_model

VOCAB = 24


def test_bf16_weights_compute_with_the_served_weights_and_restore_the_trainers() -> None:
    model = build_tiny_model(ModelConfig(tiny=TinyModelConfig()), VOCAB)
    served = build_tiny_model(ModelConfig(tiny=TinyModelConfig()), VOCAB)
    served.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name, param in served.named_parameters():
            param.copy_(served_weight(next(iter(hf_to_native(name, param)))[0], param))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    ids = torch.randint(3, VOCAB, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exact = model(input_ids=ids, use_cache=False).logits
        want = served(input_ids=ids, use_cache=False).logits
    installed = apply_trainer_numerics(model, [NumericsFeature.bf16_weights], QuantMode.none)
    logits = model(input_ids=ids, use_cache=False).logits
    assert torch.allclose(logits, want, atol=1e-5) and not torch.allclose(logits, exact, atol=1e-4)
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name  # the float32 weights are back after the forward
    torch.log_softmax(logits, -1)[..., 4].mean().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert model.model.layers[0].self_attn.q_a_proj.weight.grad.abs().sum() > 0
    installed.remove()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, use_cache=False).logits, exact)


def test_fp32_tensors_and_quantized_ones_are_not_rounded() -> None:
    model = build_tiny_model(ModelConfig(tiny=TinyModelConfig()), VOCAB)
    installed = apply_trainer_numerics(model, [NumericsFeature.bf16_weights], QuantMode.fp8_mxfp4)
    hooked = {handle.id for handle in installed.handles}
    q_a_proj = model.model.layers[0].self_attn.q_a_proj  # an FP8 linear: the engine holds its FP8 values
    assert not set(q_a_proj._forward_pre_hooks) & hooked
    assert set(model.model.embed_tokens._forward_pre_hooks) & hooked  # bf16 in the release
    hc = model.model.layers[0].attn_hc  # mHC: fp32 in the release
    assert not set(hc._forward_pre_hooks) & hooked
    installed.remove()
