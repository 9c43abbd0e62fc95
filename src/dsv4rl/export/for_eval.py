"""`dsv4rl eval SET checkpoint=RUN_DIR[/checkpoints/step_N]`: the checkpoint exported once into the run's
cache (`<run>/exports/step_N`, in the quant format the recipe's engines serve), then scored like any
model directory. A cached export is reused while its record names the same checkpoint (path and trainer
counters) and format, and every shard it lists is there."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console

from dsv4rl.config.choices import ExportFormat, QuantMode
from dsv4rl.eval.weights import export_record
from dsv4rl.export.sources import Checkpoint, find_checkpoint, trainer_counters
from dsv4rl.export.view import export_with_progress
from dsv4rl.train.checkpoint_dirs import complete_checkpoints

CHECKPOINT_ARG = "checkpoint="
EXPORTS_DIR = "exports"


def split_checkpoint_arg(args: list[str]) -> tuple[str | None, list[str]]:
    """`checkpoint=...` (at most once) out of the eval's arguments."""
    given = [a.removeprefix(CHECKPOINT_ARG) for a in args if a.startswith(CHECKPOINT_ARG)]
    if len(given) > 1:
        raise ValueError(f"checkpoint= given {len(given)} times ({given}); pass one")
    return (given[0] if given else None), [a for a in args if not a.startswith(CHECKPOINT_ARG)]


def export_dir(checkpoint: Checkpoint, quant: QuantMode) -> Path:
    suffix = "" if quant == QuantMode.none else f"-{quant.value}"
    return checkpoint.run_dir / EXPORTS_DIR / f"{checkpoint.path.name}{suffix}"


def cached(directory: Path, checkpoint: Checkpoint, quant: QuantMode) -> bool:
    record = export_record(directory)
    if record is None:
        return False
    same = (
        record.get("checkpoint") == str(checkpoint.path.resolve())
        and record.get("quant") == quant.value
        and record.get("format") == ExportFormat.native.value
        and record.get("trainer_state") == trainer_counters(checkpoint)
    )
    return same and all((directory / shard).is_file() for shard in record.get("checksums", {}))


def export_for_eval(target: str, quant: QuantMode, console: Console) -> tuple[Checkpoint, Path]:
    """The checkpoint `target` names and the model directory its weights are in (exported if needed)."""
    checkpoint = find_checkpoint(target)
    directory = export_dir(checkpoint, quant)
    if cached(directory, checkpoint, quant):
        console.print(
            f"scoring checkpoint {checkpoint.path} (step {checkpoint.step}), exported in {directory}"
        )
        return checkpoint, directory
    console.print(f"exporting checkpoint {checkpoint.path} (step {checkpoint.step}) to {directory} ...")
    export_with_progress(
        console, target=checkpoint.path, out=directory, fmt=ExportFormat.native, quant=quant, force=True
    )
    return checkpoint, directory


def run_checkpoints_note(run_dir: Path, weights: dict[str, Any]) -> str | None:
    """For `dsv4rl eval ... run.dir=RUN` without checkpoint=: the run's checkpoints are not what is
    scored; say what is, and how to score the newest checkpoint instead."""
    found = complete_checkpoints(run_dir / "checkpoints")
    if not found:
        return None
    what = (
        "the tiny model built from its seed (untrained)"
        if weights["kind"] == "tiny_model"
        else f"model.path {weights['model_path']}"
    )
    return (
        f"{run_dir} has {len(found)} checkpoint(s), newest {found[0].name}: this eval scores {what}, not "
        f"them; `dsv4rl eval <set> checkpoint={run_dir}` scores the newest (checkpoint=.../{found[0].name} "
        "names one)"
    )
