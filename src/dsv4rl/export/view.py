"""`dsv4rl export` on the console: a progress bar over the tensors, then where the model went and how to
load or serve it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dsv4rl.config.choices import ExportFormat, QuantMode
from dsv4rl.export.run import export_checkpoint


def export_with_progress(console: Console, **kwargs: Any) -> dict[str, Any]:
    columns = (
        TextColumn("exporting"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
    )
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("", total=None)

        def advance(done: int, total: int, name: str) -> None:
            bar.update(task, completed=done, total=total, description=name)

        return export_checkpoint(progress=advance, **kwargs)


def serve_hint(record: dict[str, Any]) -> list[str]:
    """How to use the directory: transformers (unquantized) and SGLang's flags for its quant mode."""
    out, quant = record["out"], QuantMode(record["quant"])
    lines = []
    if not quant.quantized:
        lines.append(f"transformers: DeepseekV4ForCausalLM.from_pretrained({out!r})")
    if record["format"] == ExportFormat.native:
        # --dtype auto reads config.json's torch_dtype (bfloat16 for bf16 and the FP8 modes); an
        # unquantized float32 export is served in float32 only when asked
        dtype = "float32" if record.get("torch_dtype") == "float32" else "auto"
        lines.append(
            f"SGLang: python -m sglang.launch_server --model-path {out} --dtype {dtype} --tp-size <GPUs> "
            "(docs/export.md)"
        )
    return lines


def print_export(record: dict[str, Any], console: Console) -> None:
    size_mb = record["total_size"] / 1e6
    console.print(
        f"[green]exported[/] step {record['step']} of {record['run']} ({record['backend']} checkpoint) to "
        f"{record['out']}: {record['tensors']} tensors, {size_mb:.1f} MB in {len(record['checksums'])} "
        f"shard(s), format {record['format']}, quant {record['quant']} ({record['seconds']:.1f} s)",
        soft_wrap=True,
    )
    for line in serve_hint(record):
        console.print(f"  {line}", soft_wrap=True, markup=False)
    console.print(f"  record: {Path(record['out']) / 'dsv4rl-export.json'}", soft_wrap=True, style="dim")
