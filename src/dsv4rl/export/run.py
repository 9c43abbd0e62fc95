"""`dsv4rl export`: one training checkpoint -> a model directory (docs/export.md).

`--format native` (default) writes the release's tensor names, dtypes and `.scale` tensors for `--quant`
(`dsv4rl.model.wire_format`, the same encoding the weight sync sends the engines), and its config.json
with the release's keys beside transformers' (`dsv4rl.model.release_config`): SGLang serves it as it
serves the released checkpoint, and transformers' `from_pretrained` loads it unquantized (its DeepSeek-V4
conversion table reads the release's names). `--format hf` writes transformers' own names (stacked
experts), unquantized. Either way: sharded safetensors with an index, the tokenizer, and
`dsv4rl-export.json` (the run, step, recipe, source checkpoint and a sha256 per shard).

The directory is built under a temporary name beside `--out` and renamed when complete: an interrupted
export leaves no half-written model behind.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from dsv4rl.config.choices import ExportFormat, QuantMode
from dsv4rl.config.compose import load_config_file
from dsv4rl.config.schema import Config
from dsv4rl.eval.weights import EXPORT_FILE
from dsv4rl.export.shards import DEFAULT_SHARD_BYTES, INDEX_FILE, ShardWriter
from dsv4rl.export.sources import (
    Checkpoint,
    ExportError,
    checkpoint_tensors,
    find_checkpoint,
    tensor_count,
    trainer_counters,
)
from dsv4rl.model.model_dir import MANIFEST_FILE
from dsv4rl.model.naming import CheckpointKind, checkpoint_kind, hf_to_native
from dsv4rl.model.native_checkpoint import CONFIG_FILE, WEIGHTS_FILE, quantization_config, read_config
from dsv4rl.model.release_config import with_release_keys
from dsv4rl.model.wire_format import WireFormat
from dsv4rl.quant.fp8 import DEFAULT_BLOCK

_NOT_TOKENIZER = {CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE, MANIFEST_FILE, EXPORT_FILE}
Progress = Callable[[int, int, str], None]  # (tensors done, tensors in all, name)


def model_dir_of(cfg: Config, run_dir: Path) -> Path:
    """The model the run started from: its tokenizer and config.json come with the export."""
    return Path(cfg.model.path) if cfg.model.path else run_dir / "model"


def check_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file: pass a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(
            f"--out {out} exists and is not empty: pass --force to replace it, or another --out"
        )


def _hf_cast(name: str, tensor: torch.Tensor, quant: QuantMode) -> torch.Tensor:
    """`--format hf`: bf16 casts what the release keeps in bf16 or quantizes; fp32-class and ints stay."""
    if quant == QuantMode.none or not tensor.dtype.is_floating_point:
        return tensor
    native = next(hf_to_native(name, tensor))[0]  # lazily: experts come as views, the first one is enough
    return tensor if checkpoint_kind(native) == CheckpointKind.fp32 else tensor.to(torch.bfloat16)


def _checkpoint_dtype(quant: QuantMode, trained: torch.dtype | None) -> str:
    """config.json's `torch_dtype`: the trainer's dtype unquantized, else bfloat16 (as the release)."""
    if quant == QuantMode.none and trained is not None:
        return str(trained).removeprefix("torch.")
    return "bfloat16"


def export_config(model_dir: Path, quant: QuantMode, fmt: ExportFormat, trained: torch.dtype | None) -> dict:
    config = read_config(model_dir)
    config.pop("quantization_config", None)
    config = with_release_keys(config, _checkpoint_dtype(quant, trained))
    wire = WireFormat(quant, tuple(DEFAULT_BLOCK))
    if fmt == ExportFormat.native and quant.quantized:
        config["quantization_config"] = quantization_config(wire)
    return config


def copy_tokenizer(cfg: Config, model_dir: Path, out: Path) -> list[str]:
    """The tokenizer's files (and generation config, chat template) of the run's model directory."""
    sources = [model_dir]
    tokenizer = Path(cfg.model.tokenizer)
    if tokenizer.is_dir() and tokenizer.resolve() != model_dir.resolve():
        sources.insert(0, tokenizer)
    copied: list[str] = []
    for source in sources:
        for path in sorted(source.iterdir()):
            wanted = path.is_file() and path.name not in _NOT_TOKENIZER and path.suffix != ".safetensors"
            if wanted and path.name not in copied:
                shutil.copy2(path, out / path.name)
                copied.append(path.name)
    if not any(name.startswith("tokenizer") for name in copied):  # a tokenizer dsv4rl builds or ships
        from dsv4rl.model.tokenizer import load_tokenizer

        load_tokenizer(cfg.model).save_pretrained(str(out))
        copied += sorted(p.name for p in out.glob("tokenizer*") if p.name not in copied)
    return copied


def export_checkpoint(
    target: str | Path,
    out: str | Path,
    step: int | None = None,
    fmt: ExportFormat = ExportFormat.native,
    quant: QuantMode = QuantMode.none,
    force: bool = False,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Export the checkpoint `target` names (a run dir: its newest, or `step`'s) to `out`; returns the
    record written to `out/dsv4rl-export.json` (plus `peak_bytes`, the streaming bound's measure)."""
    fmt, quant = ExportFormat(fmt), QuantMode(quant)
    if fmt == ExportFormat.hf and quant.quantized:
        raise ExportError(
            f"--format hf holds transformers' unquantized tensors; --quant {quant.value} needs --format "
            "native (the release's names with .scale tensors)"
        )
    out = Path(out)
    check_out(out, force)
    checkpoint = find_checkpoint(target, step)
    cfg = load_config_file(checkpoint.run_dir / "config.yaml")
    model_dir = model_dir_of(cfg, checkpoint.run_dir)
    if not (model_dir / CONFIG_FILE).is_file():
        raise ExportError(
            f"the run's model directory {model_dir} has no {CONFIG_FILE}: its config and tokenizer go with "
            "the export (model.path of the run, or <run.dir>/model for the tiny model)"
        )
    vocab_size = int(read_config(model_dir)["vocab_size"])
    partial = out.with_name(f"{out.name}.partial-{socket.gethostname()}-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        record = _write(checkpoint, cfg, model_dir, partial, fmt, quant, shard_bytes, vocab_size, progress)
        if out.exists():
            shutil.rmtree(out)
        partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    record["out"] = str(out)
    return record


def _add(writer: ShardWriter, name: str, tensor: torch.Tensor, fmt: ExportFormat, wire: WireFormat) -> None:
    """One source tensor into the writer: as is (hf, cast), or renamed and encoded (native). A function
    of its own, so its views of `tensor` (experts, casts) end with it."""
    if fmt == ExportFormat.hf:
        writer.add(name, _hf_cast(name, tensor, wire.mode))
        return
    for native, part in hf_to_native(name, tensor):
        for wire_name, encoded in wire.encode(native, part):
            writer.add(wire_name, encoded)


def _write(
    checkpoint: Checkpoint,
    cfg: Config,
    model_dir: Path,
    out: Path,
    fmt: ExportFormat,
    quant: QuantMode,
    shard_bytes: int,
    vocab_size: int,
    progress: Progress | None,
) -> dict[str, Any]:
    start = time.monotonic()
    writer = ShardWriter(out, shard_bytes)
    wire = WireFormat(quant, tuple(DEFAULT_BLOCK))
    total = tensor_count(checkpoint)
    trained: torch.dtype | None = None
    done = 0
    # (not enumerate: it keeps the previous item alive while the next one is read)
    for name, tensor in checkpoint_tensors(checkpoint, vocab_size):
        done += 1  # noqa: SIM113
        if trained is None and tensor.dtype.is_floating_point:
            trained = tensor.dtype
        _add(writer, name, tensor, fmt, wire)
        del tensor  # the writer holds its own copy: the next read must not find this one alive
        if progress is not None:
            progress(done, total, name)
    checksums = writer.close()
    config = export_config(model_dir, quant, fmt, trained)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tokenizer = copy_tokenizer(cfg, model_dir, out)
    record = {
        "run": str(checkpoint.run_dir.resolve()),
        "checkpoint": str(checkpoint.path.resolve()),
        "step": checkpoint.step,
        "backend": checkpoint.backend.value,
        "trainer_state": trainer_counters(checkpoint),
        "recipe": cfg.recipe,
        "source_model": str(model_dir.resolve()),
        "format": fmt.value,
        "quant": quant.value,
        "torch_dtype": config.get("torch_dtype"),
        "tensors": len(json.loads((out / INDEX_FILE).read_text())["weight_map"]),
        "total_size": writer.total_size,
        "checksums": checksums,  # sha256 of each shard
        "tokenizer_files": tokenizer,
        "seconds": round(time.monotonic() - start, 3),
        "dsv4rl_version": metadata.version("dsv4rl"),
    }
    (out / EXPORT_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return {**record, "peak_bytes": writer.peak_bytes, "largest_tensor_bytes": writer.largest_tensor}


def read_export_record(directory: str | Path) -> dict | None:
    path = Path(directory) / EXPORT_FILE
    return json.loads(path.read_text()) if path.is_file() else None
