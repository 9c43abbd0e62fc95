"""`dsv4rl export` of an FSDP checkpoint: the directory transformers loads gives the trainer's log-probs at
that checkpoint exactly; `--quant fp8_mxfp4` writes the release's dtypes and scales (the weight sync's own
encoding of the trained weights); the export streams (one shard in memory) and refuses what it must."""

from __future__ import annotations

import json
import sys
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from transformers import DeepseekV4ForCausalLM
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train" / "fsdp"))
from fsdp_scenarios import make_batch  # noqa: E402

from dsv4rl.algo.grpo import token_logprobs  # noqa: E402
from dsv4rl.cli import app  # noqa: E402
from dsv4rl.config.choices import QuantMode
from dsv4rl.config.compose import compose  # noqa: E402
from dsv4rl.export import sources  # noqa: E402
from dsv4rl.export.run import EXPORT_FILE, export_checkpoint  # noqa: E402
from dsv4rl.export.shards import INDEX_FILE, sha256_file  # noqa: E402
from dsv4rl.export.sources import ExportError  # noqa: E402
from dsv4rl.launcher.run import write_config  # noqa: E402
from dsv4rl.model.model_dir import materialize_model  # noqa: E402
from dsv4rl.model.naming import CheckpointKind, checkpoint_kind, scale_name, state_dict_to_native  # noqa: E402
from dsv4rl.model.native_checkpoint import checkpoint_format, load_native_model, tensor_dtypes  # noqa: E402
from dsv4rl.model.release_config import RELEASE_KEYS  # noqa: E402
from dsv4rl.model.wire_format import WireFormat  # noqa: E402
from dsv4rl.quant.fp8 import E4M3  # noqa: E402
from dsv4rl.quant.scales import E8M0  # noqa: E402
from dsv4rl.train.checkpoint import checkpoint_dir  # noqa: E402
from dsv4rl.train.fsdp.backend import FSDPBackend  # noqa: E402

STEP = 2


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    """A run dir as `dsv4rl train` leaves it (config.yaml, model/, checkpoints/step_2) and the trainer's
    log-probs and weights at that checkpoint, from the FSDP backend that wrote it."""
    run_dir = tmp_path_factory.mktemp("export") / "run"
    cfg = compose("tiny_arith", [f"run.dir={run_dir}", "optim.lr=1e-2"])
    run_dir.mkdir(parents=True)
    write_config(cfg, run_dir)
    materialize_model(cfg.model, str(run_dir / "model"), cfg.quant)
    store = dist.FileStore(str(run_dir.parent / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        backend = FSDPBackend(cfg, str(run_dir / "model"), torch.device("cpu"))
        for seed in range(STEP):
            backend.train_step(make_batch(8, seed=seed), temperature=1.0)
        backend.save_checkpoint(str(checkpoint_dir(run_dir / "checkpoints", STEP)), {"data": None})
        probe = torch.randint(3, 27, (4, 12), generator=torch.Generator().manual_seed(0))
        logprobs = backend.compute_logprobs(probe)
        weights = {name: t.detach().clone() for name, t in backend.named_weights_for_sync()}
        initial = load_native_model(str(run_dir / "model"))
    finally:
        dist.destroy_process_group()
    return {"run": run_dir, "probe": probe, "logprobs": logprobs, "weights": weights, "initial": initial}


def transformers_logprobs(directory: Path, probe: torch.Tensor) -> torch.Tensor:
    model = DeepseekV4ForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        return token_logprobs(model.eval()(input_ids=probe, use_cache=False).logits, probe, 1.0)


@pytest.mark.parametrize("fmt", ["native", "hf"])
def test_transformers_loads_the_export_with_the_trainers_logprobs(trained, tmp_path, fmt):
    out = tmp_path / fmt
    record = export_checkpoint(trained["run"], out, fmt=fmt, shard_bytes=256 * 1024)
    logprobs = transformers_logprobs(out, trained["probe"])
    assert (logprobs - trained["logprobs"]).abs().max() <= 1e-6
    # the checkpoint's weights, not the model the run started from
    before = transformers_logprobs(trained["run"] / "model", trained["probe"])
    assert (before - trained["logprobs"]).abs().max() > 1e-3

    config = json.loads((out / "config.json").read_text())
    assert all(key in config for key in RELEASE_KEYS) and config["torch_dtype"] == "float32"
    assert "quantization_config" not in config
    index = json.loads((out / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    on_disk = sorted(p.name for p in out.glob("*.safetensors"))
    assert on_disk == shards
    names = set(index["weight_map"])
    assert ("embed.weight" in names) == (fmt == "native")
    assert ("model.embed_tokens.weight" in names) == (fmt == "hf")
    saved = json.loads((out / EXPORT_FILE).read_text())
    assert saved["run"] == str(trained["run"].resolve()) and saved["step"] == STEP
    assert saved["recipe"] == "tiny_arith" and saved["backend"] == "fsdp"
    assert saved["checksums"] == {name: sha256_file(out / name) for name in shards}
    assert (out / "tokenizer.json").is_file() and record["out"] == str(out)


def test_fp8_mxfp4_has_the_releases_dtypes_and_scales(trained, tmp_path):
    out = tmp_path / "fp8"
    export_checkpoint(trained["run"], out, quant="fp8_mxfp4")
    dtypes = tensor_dtypes(out)
    assert checkpoint_format(out).mode == QuantMode.fp8_mxfp4
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8" and config["torch_dtype"] == "bfloat16"
    # every tensor as the weight sync encodes the trained weights for the engines, byte for byte
    expected = WireFormat(QuantMode.fp8_mxfp4).encode_all(state_dict_to_native(trained["weights"]))
    assert set(dtypes) == set(expected)
    with_scale = {CheckpointKind.fp8_linear: (E4M3, E8M0), CheckpointKind.routed_expert: (torch.uint8, E8M0)}
    kinds = set()
    for path in out.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118
                tensor = handle.get_tensor(name)
                assert tensor.dtype == expected[name].dtype and torch.equal(
                    tensor.view(torch.uint8), expected[name].contiguous().view(torch.uint8)
                ), name
                if name.endswith(".scale"):
                    continue
                kind = checkpoint_kind(name)
                kinds.add(kind)
                if kind in with_scale:
                    assert (dtypes[name], dtypes[scale_name(name)]) in (
                        with_scale[kind],
                        (torch.int8, E8M0),
                    ), name
                else:
                    wanted = {CheckpointKind.fp32: torch.float32, CheckpointKind.integer: torch.int64}
                    assert dtypes[name] == wanted.get(kind, torch.bfloat16), name
    assert kinds == set(CheckpointKind)
    # and it dequantizes to weights near the trained ones (what an engine serves)
    served = load_native_model(out)
    assert (served.lm_head.weight - trained["weights"]["lm_head.weight"]).abs().max() < 1e-2


def test_export_streams_one_tensor_and_one_shard_at_a_time(trained, tmp_path, monkeypatch):
    """Peak: the largest tensor plus one shard. Every tensor read from the checkpoint is freed once the
    writer holds its copy: at no point are two source tensors alive."""
    read = sources._read_one
    alive: list[weakref.ref] = []
    most = [0]

    def tracked(*args, **kwargs):
        most[0] = max(most[0], sum(ref() is not None for ref in alive))
        tensor = read(*args, **kwargs)
        alive.append(weakref.ref(tensor))
        return tensor

    monkeypatch.setattr(sources, "_read_one", tracked)
    shard = 128 * 1024
    record = export_checkpoint(trained["run"], tmp_path / "out", shard_bytes=shard)
    assert len(alive) == len(trained["weights"])  # one read per tensor
    assert most[0] == 0, f"{most[0]} source tensors still alive when the next was read"
    assert record["peak_bytes"] <= shard + record["largest_tensor_bytes"]
    assert len(record["checksums"]) >= record["total_size"] // (shard + record["largest_tensor_bytes"])


def test_refusals_name_the_problem(trained, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(ExportError, match="--force"):
        export_checkpoint(trained["run"], out)
    assert (out / "keep.txt").exists()
    export_checkpoint(trained["run"], out, force=True)
    assert not (out / "keep.txt").exists() and (out / EXPORT_FILE).is_file()
    with pytest.raises(ExportError, match="needs --format native"):
        export_checkpoint(trained["run"], tmp_path / "a", fmt="hf", quant="fp8_rollout")
    with pytest.raises(ExportError, match="step_00000007 is not a complete checkpoint"):
        export_checkpoint(trained["run"], tmp_path / "b", step=7)
    with pytest.raises(ExportError, match="not a run directory"):
        export_checkpoint(tmp_path, tmp_path / "c")
    step_dir = checkpoint_dir(trained["run"] / "checkpoints", STEP)
    assert export_checkpoint(step_dir, tmp_path / "d")["step"] == STEP
    assert not list(tmp_path.glob("*.partial-*"))  # nothing half-written left behind


def test_cli(trained, tmp_path):
    runner = CliRunner()
    out = tmp_path / "cli"
    result = runner.invoke(
        app, ["export", str(trained["run"]), "--out", str(out), "--quant", "bf16", "--json"]
    )
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout[result.stdout.index("{") :])
    assert record["quant"] == "bf16" and record["step"] == STEP
    assert checkpoint_format(out).mode == QuantMode.bf16
    again = runner.invoke(app, ["export", str(trained["run"]), "--out", str(out)])
    assert again.exit_code == 2 and "--force" in again.output
    bad = runner.invoke(
        app, ["export", str(trained["run"]), "--out", str(tmp_path / "x"), "--format", "gguf"]
    )
    assert bad.exit_code == 2 and "native, hf" in bad.output


def test_eval_of_a_run_dir_names_the_weights_it_scores(trained, tmp_path):
    """`dsv4rl eval SET run.dir=RUN` scores the run's starting model, not its checkpoints: it says so."""
    from dsv4rl.eval.weights import describe_weights, scored_weights
    from dsv4rl.export.for_eval import cached, export_dir, run_checkpoints_note, split_checkpoint_arg
    from dsv4rl.export.sources import find_checkpoint

    run = trained["run"]
    note = run_checkpoints_note(run, scored_weights(None, run / "eval" / "tiny_arith"))
    assert "1 checkpoint(s), newest step_00000002: this eval scores the tiny model" in note
    assert f"checkpoint={run}" in note
    assert run_checkpoints_note(tmp_path, scored_weights(None, tmp_path)) is None
    assert split_checkpoint_arg(["a=1", f"checkpoint={run}"]) == (str(run), ["a=1"])
    with pytest.raises(ValueError, match="2 times"):
        split_checkpoint_arg(["checkpoint=a", "checkpoint=b"])
    checkpoint = find_checkpoint(run)
    directory = export_dir(checkpoint, QuantMode.none)
    assert directory == run / "exports" / "step_00000002" and not cached(
        directory, checkpoint, QuantMode.none
    )
    export_checkpoint(run, directory)
    assert cached(directory, checkpoint, QuantMode.none)
    assert not cached(directory, checkpoint, QuantMode.bf16)
    weights = scored_weights(str(directory), run)
    assert weights["kind"] == "checkpoint" and weights["step"] == STEP
    assert describe_weights(weights).startswith("checkpoint step 2 of ")
    assert scored_weights(str(run / "model"), run)["kind"] == "model_path"
