"""`train.freeze=[router_gate,router_bias]` (the reference run's frozen router) in a short `dsv4rl train` run
of each trainer backend: the checkpoint holds every gate weight and correction bias bit for bit as the run
started (the rest trained), Adam holds no state for the gates, and the engine holds what the trainer has
after every sync (checksums). The tiny model's correction biases start at zeros in transformers; here they
are random, so a bias that was reset or moved would show."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from cli_runs import train
from safetensors.torch import load_file, save_file

from dsv4rl.config.schema import Config
from dsv4rl.export.sources import checkpoint_tensors, find_checkpoint
from dsv4rl.metrics import read_metrics
from dsv4rl.model.model_dir import MANIFEST_FILE, materialize_model
from dsv4rl.model.native_checkpoint import WEIGHTS_FILE, load_native_model

pytestmark = pytest.mark.slow

STEPS = 3
ROUTER = re.compile(r"^model\.layers\.\d+\.mlp\.gate\.(weight|e_score_correction_bias)$")
# Adam's state of a router gate weight in each backend's checkpoint (DCP keys)
ROUTER_STATE = {
    "fsdp": re.compile(r"^optim\.state\.model\.layers\.\d+\.mlp\.gate\.weight\."),
    "megatron": re.compile(r"^optimizer\.state\.exp_avg(_sq)?\.decoder\.layers\.\d+\.mlp\.router\.weight$"),
}
HEAD_STATE = {
    "fsdp": "optim.state.lm_head.weight.exp_avg",
    "megatron": "optimizer.state.exp_avg.output_layer.weight",
}


def model_with_random_biases(directory: Path) -> Path:
    """The tiny model as a native checkpoint, its score routers' correction biases drawn at random."""
    materialize_model(Config().model, str(directory))
    weights = load_file(directory / WEIGHTS_FILE)
    generator = torch.Generator().manual_seed(7)
    biases = [name for name in weights if name.endswith(".ffn.gate.bias")]
    for name in biases:
        weights[name] = torch.randn(weights[name].shape, generator=generator) * 0.1
    save_file(weights, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    (directory / MANIFEST_FILE).unlink()  # no longer the model of the seed
    assert len(biases) == 2
    return directory


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_frozen_router_stays_bit_for_bit_while_the_rest_trains(tmp_path: Path, backend: str) -> None:
    model = model_with_random_biases(tmp_path / "model")
    run_dir = tmp_path / "run"
    train(
        run_dir,
        f"parallel.train.backend={backend}",
        f"model.path={model}",
        f"model.tokenizer={model}",
        "train.freeze=[router_gate,router_bias]",
        f"train.steps={STEPS}",
        f"train.checkpoint_every={STEPS}",
        "algo.prompts_per_step=4",
        "algo.group_size=4",
        "sync.verify.every_steps=1",
    )
    initial = load_native_model(str(model), dtype=torch.float32).state_dict()
    checkpoint = find_checkpoint(run_dir)
    assert checkpoint.step == STEPS
    final = dict(checkpoint_tensors(checkpoint, vocab_size=initial["lm_head.weight"].shape[0]))
    frozen = sorted(name for name in initial if ROUTER.match(name))
    assert len(frozen) == 5  # 3 gate weights (the hash-routed layer's too), 2 biases
    assert all(initial[name].abs().sum() > 0 for name in frozen)
    assert [name for name in frozen if not torch.equal(final[name], initial[name])] == []
    trained = [name for name in initial if name in final and not torch.equal(final[name], initial[name])]
    assert "lm_head.weight" in trained and "model.layers.1.mlp.experts.gate_up_proj" in trained
    # Adam's state: none for the gates, some for the rest
    keys = set(dcp.FileSystemReader(str(checkpoint.path)).read_metadata().state_dict_metadata)
    assert HEAD_STATE[backend] in keys
    assert [key for key in keys if ROUTER_STATE[backend].match(key)] == []
    # every sync checked: the engine held exactly what the trainer sent, the frozen router included
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert [line["step"] for line in metrics] == list(range(1, STEPS + 1))
    assert all(line["verify_checksum_tensors"] > 150 for line in metrics)
    log = (run_dir / "logs" / "trainer.log").read_text()
    assert "train.freeze keeps 1,552 of " in log  # 3 x 8 x 64 gate weights + 2 x 8 biases
    assert "router_gate: 3 tensors, 1,536 elements; router_bias: 2 tensors, 16 elements" in log
