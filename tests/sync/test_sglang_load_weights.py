"""A full push into SGLang 0.5.23's own DeepseekV4ForCausalLM, built on CPU in SGLang's interpreter.

For each quant mode SGLang takes updates in (`none`, `bf16`, `fp8_rollout`, and the reference recipe's
arrangement: a checkpoint with MXFP4 experts that `SGLANG_DSV4_FP4_DEQUANT=1` turns into FP8 at load, then
`fp8_rollout` pushes), the engine starts from the model directory dsv4rl writes, the trainer's weights
(the same model, moved as a training step would) go through dsv4rl's sync pipeline with the wire format
dsv4rl predicts for that engine (`served_format`), and SGLang's `load_weights` takes every request as its
weight updater would. Then every SGLang parameter must equal what was sent for it, after SGLang's renames
and fusions (`sglang_push.expected_sglang_params`), bit for bit; no parameter may be left unexplained and
SGLang may warn about nothing. Negative controls: a renamed tensor, a fusion pair split across requests and
a wrong scale shape each fail with SGLang's own message. About 20 s for the first build (SGLang's
imports), a few seconds each after.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from sglang_push import expected_sglang_params, push_buckets, write_requests

from dsv4rl.config.choices import QuantMode, RolloutEngineKind
from dsv4rl.config.compose import compose
from dsv4rl.config.schema import QuantConfig
from dsv4rl.model.model_dir import materialize_model
from dsv4rl.model.native_checkpoint import checkpoint_format, read_config, read_tensors
from dsv4rl.model.tiny import load_model
from dsv4rl.model.tokenizer import load_tokenizer
from dsv4rl.quant import sglang_moe
from dsv4rl.quant.formats import dequantize
from dsv4rl.sync.served_format import served_format, wire_format_for
from sglang_runner import SGLangError, needs_sglang

pytestmark = [*needs_sglang, pytest.mark.slow]

BUCKET_BYTES = 256 << 10  # a push of many requests, so fusion partners must be kept together across them
CASES = {  # case: (recipe's quant, the checkpoint's format); quant=none runs SGLang at --dtype float32
    "none": ("none", "none"),
    "bf16": ("bf16", "bf16"),
    "fp8_rollout": ("fp8_rollout", "fp8_rollout"),
    "fp8_rollout_from_mxfp4": ("fp8_rollout", "fp8_mxfp4"),  # dapo_math's: FP4 experts de-quantized on load
}


def _recipe(quant: str):
    dtype = (
        ["engine.dtype=float32"] if quant == "none" else []
    )  # validation refuses float32 into bf16 engines
    return compose(
        "tiny_arith",
        [
            "model=tiny_dsv4_sglang",
            f"quant={quant}",
            "parallel.rollout.engine=sglang",
            "cluster.device=h200",
            *dtype,
        ],
    )


def _trainer_weights(cfg) -> dict[str, torch.Tensor]:
    """The model the checkpoint holds, after a step: every float tensor moved, the hash table permuted."""
    model = load_model(cfg.model, vocab_size=len(load_tokenizer(cfg.model)))
    generator = torch.Generator().manual_seed(1)
    out = {}
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point():
            spread = tensor.float().abs().mean() + 1e-3
            out[name] = tensor + 0.1 * spread * torch.randn(tensor.shape, generator=generator)
        else:  # tid2eid: each token's experts shifted by one
            out[name] = (tensor + 1) % cfg.model.tiny.n_routed_experts
    return out


class Push:
    """One engine start and push for `case`, through SGLang; `run` may rewrite the requests first."""

    def __init__(self, case: str, tmp: Path) -> None:
        quant, checkpoint = CASES[case]
        self.cfg = _recipe(quant)
        self.tmp = tmp
        self.model_dir = materialize_model(
            self.cfg.model, str(tmp / "model"), QuantConfig(name=QuantMode(checkpoint))
        )
        self.config = read_config(self.model_dir)
        stored, moe = checkpoint_format(self.model_dir), sglang_moe.recipe_moe_path(self.cfg)
        served = served_format(
            RolloutEngineKind.sglang, stored, self.cfg.quant.engine_env, self.model_dir, moe
        )
        self.wire_format = wire_format_for(self.cfg.quant, [("engine-0", served)])
        self.load_format = self.cfg.sync.load_format.value
        self.buckets = push_buckets(
            _trainer_weights(self.cfg).items(), self.wire_format, BUCKET_BYTES, self.load_format
        )

    def run(self, sides) -> tuple[dict, dict[str, torch.Tensor]]:
        push_dir, out_dir = self.tmp / "push", self.tmp / "sglang"
        shutil.rmtree(push_dir, ignore_errors=True)
        out_dir.mkdir(exist_ok=True)
        sent = write_requests(self.buckets, self.load_format, push_dir)
        side = sides.get({str(k): str(v) for k, v in self.cfg.quant.engine_env.items()})
        result = side.call(
            "engine_model:load_and_push", model_path=self.model_dir, dtype=self.cfg.engine.dtype.value,
            push_dir=str(push_dir), out_dir=str(out_dir),
        )  # fmt: skip
        return result, sent


# Each request is a partial load, and SGLang's load_weights lists what a call did not set; the comparison
# below checks that the push as a whole set every parameter.
PARTIAL_LOAD = "Some weights are not initialized from checkpoints"
# Parameters no checkpoint carries: the FP8 KV cache's scales, which SGLang itself leaves out of its check of
# what a load set (`skipped_checking_patterns`, sglang/srt/models/deepseek_v4.py:5613-5617).
NOT_WEIGHTS = ("attn_mqa.k_scale", "attn_mqa.v_scale", "blockscale_swizzled")


def check_loaded(
    result: dict, sent: dict[str, torch.Tensor], config: dict, pushed: dict[str, torch.Tensor]
) -> int:
    """Every SGLang parameter equals what was sent for it; returns how many were compared."""
    warnings = [w[:300] for w in result["push_warnings"] if PARTIAL_LOAD not in w]
    assert not warnings, "SGLang warned while loading the push:\n" + "\n".join(warnings)
    expected, partial = expected_sglang_params(sent, config, result["params"])
    unexplained = sorted(n for n in set(pushed) - set(expected) if not any(p in n for p in NOT_WEIGHTS))
    assert not unexplained, f"SGLang parameters no sent tensor explains: {unexplained}"
    for name, value in expected.items():
        held = pushed[name][: value.shape[0]] if name in partial else pushed[name]
        assert held.dtype == value.dtype and held.shape == value.shape, name
        assert torch.equal(held.view(torch.uint8), value.contiguous().view(torch.uint8)), f"{name} differs"
    return len(expected)


@pytest.mark.parametrize("case", list(CASES))
def test_sglang_loads_every_tensor_of_a_push(case: str, tmp_path: Path, sglang_sides) -> None:
    push = Push(case, tmp_path)
    result, sent = push.run(sglang_sides)
    pushed = load_file(str(tmp_path / "sglang" / "pushed.safetensors"))
    compared = check_loaded(result, sent, push.config, pushed)
    assert compared == len([n for n in pushed if not any(p in n for p in NOT_WEIGHTS)])
    # the start-up load of dsv4rl's checkpoint, before the push: the same rules over the files
    startup = load_file(str(tmp_path / "sglang" / "startup.safetensors"))
    checkpoint = read_tensors(push.model_dir)
    if case == "fp8_rollout_from_mxfp4":
        # SGLang turned the MXFP4 experts into FP8 128x128 blocks with float32 scales, as served_format says
        assert push.wire_format.expert_scale_dtype == torch.float32
        w13, scale = (
            startup["model.layers.1.mlp.experts.w13_weight"],
            startup["model.layers.1.mlp.experts.w13_weight_scale_inv"],
        )
        assert w13.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
        expert = "layers.1.ffn.experts.0"
        mx = torch.cat(
            [
                dequantize(checkpoint[f"{expert}.{w}.weight"], checkpoint[f"{expert}.{w}.scale"])
                for w in ("w1", "w3")
            ]
        )
        torch.testing.assert_close(
            dequantize(w13[0], scale[0]), mx, rtol=0.125, atol=1e-6
        )  # FP8's 3 mantissa bits
        checkpoint = {k: v for k, v in checkpoint.items() if ".ffn.experts." not in k}
        startup = {k: v for k, v in startup.items() if ".mlp.experts." not in k}
    expected, partial = expected_sglang_params(checkpoint, push.config, result["params"])
    for name, value in expected.items():
        held = startup[name][: value.shape[0]] if name in partial else startup[name]
        assert torch.equal(held.view(torch.uint8), value.contiguous().view(torch.uint8)), f"start-up: {name}"
    # the push, not the start-up load, set them: every weight moved (block scales may not, at this step size)
    before = load_file(str(tmp_path / "sglang" / "startup.safetensors"))
    unmoved = [n for n in expected if "scale" not in n and torch.equal(pushed[n], before[n])]
    assert not unmoved, unmoved


def _edit(buckets: list[list], name: str, edit) -> None:
    """Apply `edit(tensor) -> (name, tensor)` to the tensor called `name` where it is sent."""
    for bucket in buckets:
        for index, (sent_name, tensor) in enumerate(bucket):
            if sent_name == name:
                bucket[index] = edit(tensor)
                return
    raise KeyError(name)


def test_a_renamed_tensor_fails_with_sglangs_message(tmp_path: Path, sglang_sides) -> None:
    push = Push("bf16", tmp_path)
    _edit(push.buckets, "layers.0.attn.q_norm.weight", lambda t: ("layers.0.attn.q_nrm.weight", t))
    result, sent = push.run(sglang_sides)
    pushed = load_file(str(tmp_path / "sglang" / "pushed.safetensors"))
    with pytest.raises(
        AssertionError, match=r"model\.layers\.0\.self_attn\.q_nrm\.weight not found in params_dict"
    ):
        check_loaded(result, sent, push.config, pushed)


def test_a_fusion_pair_split_across_requests_fails_in_sglang(tmp_path: Path, sglang_sides) -> None:
    push = Push("fp8_rollout", tmp_path)
    moved = []
    for bucket in push.buckets:  # wkv and its scale leave wq_a's request for one of their own
        moved += [item for item in bucket if item[0].startswith("layers.1.attn.wkv.")]
        bucket[:] = [item for item in bucket if not item[0].startswith("layers.1.attn.wkv.")]
    assert len(moved) == 2
    push.buckets.append(moved)
    with pytest.raises(SGLangError, match=r"AssertionError: .*layers\.1\.self_attn\.wqkv_a"):
        push.run(sglang_sides)


def test_a_wrong_scale_shape_fails_in_sglangs_loader(tmp_path: Path, sglang_sides) -> None:
    push = Push("fp8_rollout", tmp_path)
    _edit(
        push.buckets, "layers.1.attn.wo_b.scale", lambda t: ("layers.1.attn.wo_b.scale", t.t().contiguous())
    )
    # wo_b is a RowParallelLinear: its scale goes through SGLang's load_row_parallel_weight, which asserts
    with pytest.raises(SGLangError, match=r"load_row_parallel_weight\n\s+assert self\.data\.shape == loaded"):
        push.run(sglang_sides)
