"""`train.numerics.*` in the fsdp backend (one rank, in-process): the trainer computes with SGLang's FP8
KV cache and FP8 activations (straight-through), and still trains."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dsv4rl.config.choices import QuantMode
from dsv4rl.config.model_schema import ModelConfig
from dsv4rl.config.schema import Config, QuantConfig
from dsv4rl.model.model_dir import materialize_model
from dsv4rl.model.sglang_rounding import fp8_activation


@pytest.fixture
def world_of_one(tmp_path: Path):  # noqa: ANN201
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def backend(tmp_path: Path, **numerics: bool):  # noqa: ANN201
    from dsv4rl.train.fsdp.backend import FSDPBackend

    cfg = Config()
    cfg.quant = QuantConfig(name=QuantMode.fp8_mxfp4)
    for key, value in numerics.items():
        setattr(cfg.train.numerics, key, value)
    path = materialize_model(ModelConfig(), str(tmp_path / "model"), cfg.quant)
    return FSDPBackend(cfg, path, torch.device("cpu"))


def test_trainer_rounds_as_sglang_and_gradients_flow(world_of_one, tmp_path: Path) -> None:
    ids = torch.randint(3, 20, (4, 24), generator=torch.Generator().manual_seed(0))
    plain = backend(tmp_path).compute_logprobs(ids)
    rounded_backend = backend(tmp_path, kv_fp8=True, act_fp8=True)
    seen: list[torch.Tensor] = []
    q_a_proj = rounded_backend.model.model.layers[1].self_attn.q_a_proj
    handle = q_a_proj.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach()))
    rounded = rounded_backend.compute_logprobs(ids)
    handle.remove()
    assert torch.equal(fp8_activation(seen[0]), seen[0])  # the FP8 linear's input is on SGLang's grid
    assert 1e-6 < (rounded - plain).abs().mean() < 0.05
    model = rounded_backend.model
    logits = model(input_ids=ids, use_cache=False).logits
    torch.log_softmax(logits, -1)[..., 4].mean().backward()
    grad = q_a_proj.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
