"""No weight decay on norms, sinks, mHC, position biases, biases and the indexer, in both trainer backends:
the rule (`dsv4rl.train.weight_decay`) on both name vocabularies, and the optimizer groups each backend
builds for the tiny model, by transformers name (`weight_decay_groups.py`, in a process of its own)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv4rl.train.weight_decay import decays, param_groups

SCRIPT = Path(__file__).with_name("weight_decay_groups.py")
SPARED = re.compile(r"(norm\.weight|\.sinks|position_bias)$|_hc\.|hc_head\.|\.indexer\.")
MATRIX, VECTOR = torch.zeros(4, 4), torch.zeros(4)


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.self_attn.q_a_proj.weight",
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.embed_tokens.weight",
        "lm_head.weight",
        "module.decoder.layers.0.self_attention.linear_q_down_proj.weight",
        "module.decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight",
        "module.decoder.layers.0.mlp.router.weight",
        "module.output_layer.weight",
    ],
)
def test_matrices_decay(name: str) -> None:
    assert decays(name, MATRIX)


@pytest.mark.parametrize(
    ("name", "param"),
    [
        ("model.layers.0.input_layernorm.weight", VECTOR),
        ("model.layers.0.self_attn.sinks", VECTOR),
        ("model.layers.0.attn_hc.fn", MATRIX),  # 2-D: megatron's own rule (1-D, biases) decays it
        ("model.hc_head.hc_fn", MATRIX),
        ("model.layers.1.self_attn.compressor.position_bias", MATRIX),
        ("some.linear.bias", MATRIX),
        ("module.decoder.layers.0.self_attention.attn_sink", VECTOR),
        ("module.decoder.layers.0.mlp_hyper_connection.fn", MATRIX),
        ("module.decoder.layers.0.self_attention_hyper_connection.scale", VECTOR),
        ("module.decoder.hc_head.fn", MATRIX),
        ("module.decoder.layers.1.self_attention.indexer.compressor.ape", MATRIX),
        ("module.decoder.final_layernorm.weight", VECTOR),
        ("model.layers.1.self_attn.compressor.indexer.q_b_proj.weight", MATRIX),  # no gradient reaches it
        ("module.decoder.layers.1.self_attention.indexer.linear_wq_b.weight", MATRIX),
    ],
)
def test_scales_offsets_and_mixing_do_not_decay(name: str, param: torch.Tensor) -> None:
    assert not decays(name, param)


def test_param_groups_split_trainable_parameters_and_leave_out_empty_groups() -> None:
    linear, norm = torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)
    frozen = torch.nn.Parameter(torch.zeros(4, 4), requires_grad=False)
    named = [("proj.weight", linear.weight), ("proj.bias", linear.bias), ("ln.weight", norm.weight)]
    groups = param_groups([*named, ("frozen.weight", frozen)], 0.1)
    assert [(len(g["params"]), g["weight_decay"]) for g in groups] == [(1, 0.1), (2, 0.0)]
    assert param_groups([("ln.weight", norm.weight)], 0.1) == [{"params": [norm.weight], "weight_decay": 0.0}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def groups(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("weight_decay") / "groups.json"
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(out)], capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("backend", ["fsdp", "megatron_cpu", "megatron_gpu"])
def test_each_backend_decays_the_same_parameters_of_the_tiny_model(groups: dict, backend: str) -> None:
    every = set(groups["all"])
    spared = {name for name in every if SPARED.search(name)}
    assert groups[backend] == {"0.1": sorted(every - spared), "0.0": sorted(spared)}
    # what the rule adds to megatron's own (1-D parameters, biases): the 2-D mHC and position biases
    assert (
        "model.layers.0.attn_hc.fn" in spared
        and "model.layers.1.self_attn.compressor.position_bias" in spared
    )
    assert "model.layers.0.mlp.experts.gate_up_proj" not in spared and "lm_head.weight" not in spared
