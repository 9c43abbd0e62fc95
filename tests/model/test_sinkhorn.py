"""The mHC Sinkhorn rounds on the [N, N, tokens] layout: the plain loop's values bit for bit, its gradients
to float32 rounding, and transformers' module switched without changing the model's output."""

import copy

import pytest
import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection

from dsv4rl.config.model_schema import ModelConfig
from dsv4rl.model.model_dir import materialize_model
from dsv4rl.model.native_checkpoint import load_native_model
from dsv4rl.model.sinkhorn import FastSinkhornHyperConnection, sinkhorn, sinkhorn_rounds, use_fast_sinkhorn
from dsv4rl.model.tiny import build_tiny_model

EPS = 1e-6


def plain_sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The release's and transformers' loop, written out."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


@pytest.mark.parametrize("shape", [(3, 5, 4, 4), (7, 1, 4, 4), (2, 3, 3, 3)])
@pytest.mark.parametrize("iters", [1, 2, 20])
def test_values_bitwise_and_gradients_close(shape, iters):
    g = torch.Generator().manual_seed(iters)
    comb = torch.softmax(torch.randn(shape, generator=g), dim=-1) + EPS
    upstream = torch.randn(shape, generator=g)
    plain_in, fast_in = comb.clone().requires_grad_(), comb.clone().requires_grad_()
    plain, fast = plain_sinkhorn(plain_in, iters, EPS), sinkhorn(fast_in, iters, EPS)
    assert torch.equal(fast, plain) and fast.shape == shape and fast.is_contiguous()
    plain.backward(upstream)
    fast.backward(upstream)
    torch.testing.assert_close(fast_in.grad, plain_in.grad, rtol=1e-5, atol=1e-5)
    assert sinkhorn_rounds(comb, 0, EPS) is comb


def test_gradient_matches_finite_differences():
    g = torch.Generator().manual_seed(0)
    comb = (torch.softmax(torch.randn(2, 1, 4, 4, generator=g), -1) + EPS).double().requires_grad_()
    assert torch.autograd.gradcheck(lambda c: sinkhorn(c, 5, EPS), (comb,))


def test_switched_modules_give_the_same_logits_and_close_gradients():
    model = build_tiny_model(ModelConfig(init_seed=3), 27)
    plain = copy.deepcopy(model)
    layers = model.config.num_hidden_layers
    assert use_fast_sinkhorn(model) == 2 * layers and use_fast_sinkhorn(model) == 0  # idempotent
    fast_modules = [m for m in model.modules() if isinstance(m, FastSinkhornHyperConnection)]
    assert len(fast_modules) == 2 * layers and all(m.sinkhorn_rounds_left == 19 for m in fast_modules)
    assert not [m for m in model.modules() if type(m) is DeepseekV4HyperConnection]
    ids = torch.randint(0, 27, (4, 9), generator=torch.Generator().manual_seed(1))
    fast_logits, plain_logits = model(ids).logits, plain(ids).logits
    assert torch.equal(fast_logits, plain_logits)
    fast_logits.square().mean().backward()
    plain_logits.square().mean().backward()
    for (name, a), b in zip(model.named_parameters(), plain.parameters(), strict=True):
        if b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_loaded_models_use_the_fast_rounds(tmp_path):
    model = load_native_model(materialize_model(ModelConfig(), tmp_path / "m"))
    assert any(isinstance(m, FastSinkhornHyperConnection) for m in model.modules())
    assert not [m for m in model.modules() if type(m) is DeepseekV4HyperConnection]
