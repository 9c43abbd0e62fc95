"""`--numerics sglang`: the reference engine computes with SGLang's rounding points, chosen by flag and by
the checkpoint it serves; bad feature sets are refused naming the flag."""

from __future__ import annotations

import pytest
import torch

from dsv4rl.config.choices import NumericsFeature
from dsv4rl.engine.args import ServerArgs, parse_args
from dsv4rl.engine.numerics import fp8_storage, numerics_features
from dsv4rl.model.naming import copy_native_into
from dsv4rl.model.sglang_rounding import round_bf16

F = NumericsFeature


def args(**kwargs) -> ServerArgs:
    return ServerArgs(model_path="unused", **kwargs)


def test_flags_parse() -> None:
    parsed = parse_args(
        [
            "--model-path",
            "m",
            "--numerics",
            "sglang",
            "--numerics-features",
            "kv_fp8,bf16_logits",
            "--enable-fp32-lm-head",
        ]
    )
    assert parsed["numerics"] == "sglang" and parsed["numerics_features"] == "kv_fp8,bf16_logits"
    assert parsed["enable_fp32_lm_head"] is True
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "m", "--numerics", "fp16"])


def test_feature_sets() -> None:
    assert numerics_features(args(), fp8_checkpoint=True) == frozenset()
    assert numerics_features(args(numerics="sglang"), fp8_checkpoint=True) == frozenset(F)
    assert F.act_fp8 not in numerics_features(args(numerics="sglang"), fp8_checkpoint=False)
    lm_head = numerics_features(args(numerics="sglang", enable_fp32_lm_head=True), fp8_checkpoint=False)
    assert F.bf16_logits not in lm_head and F.kv_fp8 in lm_head
    chosen = numerics_features(
        args(numerics="sglang", numerics_features="kv_fp8, mhc_tf32"), fp8_checkpoint=False
    )
    assert chosen == {F.kv_fp8, F.mhc_tf32}


@pytest.mark.parametrize(
    ("kwargs", "fp8", "message"),
    [
        ({"numerics_features": "kv_fp8"}, False, "needs --numerics sglang"),
        ({"numerics": "sglang", "numerics_features": "kv_fp9"}, False, "unknown \\['kv_fp9'\\]; choose from"),
        ({"numerics": "sglang", "numerics_features": "act_fp8"}, False, "not FP8"),
        (
            {"numerics": "sglang", "numerics_features": "bf16_logits", "enable_fp32_lm_head": True},
            True,
            "drop one",
        ),
    ],
)
def test_bad_feature_sets_are_refused(kwargs: dict, fp8: bool, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        numerics_features(args(**kwargs), fp8_checkpoint=fp8)


def test_fp8_storage_reads_the_checkpoint() -> None:
    fp8 = torch.zeros(2, 2, dtype=torch.float8_e4m3fn)
    bf16 = torch.zeros(2, 2, dtype=torch.bfloat16)
    assert fp8_storage({"layers.0.attn.wq_a.weight": fp8, "layers.0.ffn.experts.0.w1.weight": bf16}) == (
        True,
        False,
    )
    assert fp8_storage({"layers.0.ffn.experts.0.w1.weight": fp8}) == (False, True)
    assert fp8_storage({"layers.0.attn.wq_a.weight": bf16}) == (False, False)


def test_sglang_engine_holds_bf16_weights_and_rounds_its_logprobs(make_client) -> None:
    body = {
        "input_ids": [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6],
        "return_logprob": True,
        "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
    }
    exact = make_client()
    sglang = make_client(numerics="sglang")
    engine = sglang.app.state.engine
    assert engine.numerics == frozenset(F) - {F.act_fp8}  # the tiny checkpoint's linears are not FP8
    model = engine.model.model
    norm, mix = model.layers[0].input_layernorm.weight, model.layers[0].attn_hc.fn
    assert torch.equal(norm, round_bf16(norm)) and not torch.equal(mix, round_bf16(mix))  # mHC stays fp32

    def logprobs(client) -> list[float]:
        response = client.post("/generate", json=body)
        assert response.status_code == 200, response.text
        return [entry[0] for entry in response.json()["meta_info"]["input_token_logprobs"][1:]]

    a, b = logprobs(exact), logprobs(sglang)
    assert len(a) == len(b) == 11
    assert 1e-6 < max(abs(x - y) for x, y in zip(a, b, strict=True)) < 0.5
    # a weight update lands rounded too (the forward model is refreshed from the held tensors)
    name = "layers.0.attn_norm.weight"
    new = torch.full_like(engine.weights.state()[name], 1 + 2**-10)
    engine.weights.commit({name: new})
    assert model.layers[0].input_layernorm.weight.unique().tolist() == [1.0]
    state = engine.model.state_dict(keep_vars=True)
    copy_native_into(state, name, new)  # what the exact rule would have written
    assert model.layers[0].input_layernorm.weight.unique().tolist() == [1 + 2**-10]
