"""WeightSync throughput over gloo on loopback, against host memcpy, in one run.

    python bench/weight_sync.py [--out bench/results/weight_sync.json] [--quick]

Measures, in this order and in this process:
1. host memcpy: `torch.Tensor.copy_` of the synthetic tensor set into preallocated tensors (best of 3);
2. `WeightSync.push` of the tiny model (trainer seed 22) into a real reference engine
   (`python -m dsv4rl.engine`, seed 11), per-tensor and flattened_bucket, one bucket and small buckets;
3. `WeightSync.push` of the synthetic set (64 x 4 MiB fp32 = 256 MiB) into an engine whose
   WeightReceiver targets a module of the same shapes, with 1 GiB / 64 MiB / 16 MiB buckets, per-tensor
   and flattened_bucket.
Prints a table (bytes, seconds, GB/s, ratio to memcpy, ratio to the 1 GiB bucket, transfer vs total time)
and writes every number as JSON to --out. See bench/README.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import (
    MIB,
    ROOT,
    Engines,
    bench_main,
    fmt_bytes,
    free_port,
    measure_memcpy,
    run_meta,
)

DEFAULT_OUT = ROOT / "bench" / "results" / "weight_sync.json"
ENGINE_SEED = 11  # the engine starts from this tiny model ...
TRAINER_SEED = 22  # ... and the trainer pushes this one
FLAT = "flattened_bucket"

# Sizes per mode: synthetic set, its bucket sizes, tiny-model bucket sizes, repeats, and the time bounds.
MODES: dict[str, dict[str, Any]] = {
    "full": {
        "synth_mib": 256,
        "synth_tensor_side": 1024,  # 64 fp32 tensors of 1024 x 1024 (4 MiB each)
        "synth_buckets": [1 << 30, 64 * MIB, 16 * MIB],
        "tiny_buckets": [1 << 30, 256 << 10, 64 << 10],  # the tiny model is ~1 MiB: same bucket counts
        "synth_repeats": 5,
        "tiny_repeats": 10,
        "memcpy_repeats": 3,
        "startup_s": 180.0,
        "sync_timeout_s": 120.0,
    },
    "quick": {
        "synth_mib": 32,
        "synth_tensor_side": 512,  # 32 fp32 tensors of 512 x 512 (1 MiB each)
        "synth_buckets": [1 << 30, 8 * MIB, 2 * MIB],  # 1 / 4 / 16 buckets, as in the full run
        "tiny_buckets": [1 << 30, 64 << 10],
        "synth_repeats": 1,
        "tiny_repeats": 2,
        "memcpy_repeats": 3,
        "startup_s": 60.0,
        "sync_timeout_s": 30.0,
    },
}


# ---------------------------------------------------------------------------------------------- helpers
@torch.no_grad()
def trainer_model(seed: int) -> torch.nn.Module:
    """The tiny model from `seed`, with tensors every seed initialises alike (zeros, ones) randomised."""
    from dsv4rl.config.model_schema import ModelConfig
    from dsv4rl.model.tiny import build_tiny_model
    from dsv4rl.model.tokenizer import build_char_tokenizer

    model = build_tiny_model(ModelConfig(init_seed=seed), len(build_char_tokenizer()))
    generator = torch.Generator().manual_seed(seed)
    for tensor in model.state_dict(keep_vars=True).values():
        if tensor.dtype.is_floating_point and tensor.numel() and bool((tensor == tensor.flatten()[0]).all()):
            tensor.add_(0.05 * torch.randn(tensor.shape, generator=generator))
    return model


def synthetic(total_mib: int, side: int, seed: int) -> torch.nn.Module:
    """fp32 buffers of side x side adding up to `total_mib` MiB, named w0, w1, ..."""
    module = torch.nn.Module()
    gen = torch.Generator().manual_seed(seed)
    for i in range(total_mib * MIB // (4 * side * side)):
        module.register_buffer(f"w{i}", torch.randn(side, side, generator=gen))
    return module


# ---------------------------------------------------------------------------------------------- engines
def serve_synthetic(port: int, model_dir: str, total_mib: int, side: int) -> None:
    """Engine process: the reference engine whose WeightReceiver targets the synthetic module."""
    import uvicorn

    from dsv4rl.engine.server import create_app
    from dsv4rl.engine.weight_receiver import WeightReceiver
    from dsv4rl.engine.weight_store import HeldWeights

    receiver = WeightReceiver(HeldWeights(synthetic(total_mib, side, seed=0).state_dict()))
    app = create_app(model_dir, receiver=receiver, port=port, num_threads=1, random_seed=0)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=5)


# ---------------------------------------------------------------------------------------------- measure
def measure_sync(
    url: str,
    named: list[tuple[str, torch.Tensor]],
    *,
    set_name: str,
    bucket_bytes: int,
    load_format: str,
    repeats: int,
    timeout_s: float,
) -> dict[str, Any]:
    from dsv4rl.config.schema import SyncConfig
    from dsv4rl.engine_client.client import EngineClient
    from dsv4rl.sync.weight_sync import WeightSync

    cfg = SyncConfig(bucket_bytes=bucket_bytes, timeout_s=timeout_s)
    client = EngineClient(url, timeout_s=timeout_s, retries=0)
    runs = []
    with WeightSync([client], cfg, "gloo", "127.0.0.1", free_port(), load_format=load_format) as sync:
        for i in range(repeats):
            runs.append(sync.push(named, f"bench-{set_name}-{bucket_bytes}-{load_format}-{i}"))
    best = min(runs, key=lambda s: s.seconds)
    return {
        "set": set_name,
        "format": load_format,
        "bucket_bytes": bucket_bytes,
        "repeats": repeats,
        "bytes": best.bytes,
        "tensors": best.tensors,
        "buckets": best.buckets,
        "seconds": best.seconds,
        "median_seconds": statistics.median(s.seconds for s in runs),
        "transfer_seconds": best.transfer_seconds,
        "overhead_seconds": best.seconds - best.transfer_seconds,
        "transfer_fraction": best.transfer_seconds / best.seconds if best.seconds > 0 else 0.0,
        "gb_per_s": best.gb_per_s,
        "transfer_gb_per_s": best.transfer_gb_per_s,
        "runs": [{"seconds": s.seconds, "transfer_seconds": s.transfer_seconds} for s in runs],
    }


def add_ratios(syncs: list[dict[str, Any]], memcpy_gb_per_s: float) -> None:
    """ratio_vs_memcpy: sync GB/s / memcpy GB/s; ratio_vs_1gib: GB/s / same set+format at 1 GiB."""
    one_bucket = {(s["set"], s["format"]): s for s in syncs if s["bucket_bytes"] == 1 << 30}
    for s in syncs:
        s["ratio_vs_memcpy"] = s["gb_per_s"] / memcpy_gb_per_s
        s["transfer_ratio_vs_memcpy"] = s["transfer_gb_per_s"] / memcpy_gb_per_s
        ref = one_bucket.get((s["set"], s["format"]))
        s["ratio_vs_1gib"] = s["gb_per_s"] / ref["gb_per_s"] if ref and ref["gb_per_s"] > 0 else None


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    meta, mem = result["meta"], result["memcpy"]
    console = Console(width=max(shutil.get_terminal_size((190, 24)).columns, 190))
    table = Table(
        title=(
            f"WeightSync over gloo/loopback ({meta['mode']}; torch {meta['torch']}, "
            f"{meta['cpu_count']} CPUs, "
            f"commit {(meta['git_commit'] or '?')[:10]}{'+dirty' if meta['git_dirty'] else ''})"
        ),
        caption="best of N pushes (by total seconds); x memcpy = GB/s / memcpy GB/s; "
        "transfer = time inside bucket POST ∥ broadcast, the rest is pause/begin/end/flush/version/continue",
    )
    for col, justify in [
        ("set", "left"),
        ("format", "left"),
        ("bucket", "right"),
        ("buckets", "right"),
        ("MiB", "right"),
        ("best s", "right"),
        ("median s", "right"),
        ("GB/s", "right"),
        ("x memcpy", "right"),
        ("vs 1 GiB", "right"),
        ("transfer s", "right"),
        ("transfer %", "right"),
        ("transfer GB/s", "right"),
        ("xfer x memcpy", "right"),
    ]:
        table.add_column(col, justify=justify, no_wrap=True)
    table.add_row(
        "memcpy (copy_)",
        "-",
        "-",
        "-",
        f"{mem['bytes'] / MIB:.1f}",
        f"{mem['seconds']:.4f}",
        f"{mem['median_seconds']:.4f}",
        f"{mem['gb_per_s']:.2f}",
        "1",
        "-",
        "-",
        "-",
        "-",
        "-",
        end_section=True,
    )
    for s in result["syncs"]:
        vs = "-" if s["ratio_vs_1gib"] is None else f"{s['ratio_vs_1gib']:.2f}"
        table.add_row(
            s["set"],
            s["format"],
            fmt_bytes(s["bucket_bytes"]),
            str(s["buckets"]),
            f"{s['bytes'] / MIB:.1f}",
            f"{s['seconds']:.4f}",
            f"{s['median_seconds']:.4f}",
            f"{s['gb_per_s']:.3f}",
            f"{s['ratio_vs_memcpy']:.3f}",
            vs,
            f"{s['transfer_seconds']:.4f}",
            f"{100 * s['transfer_fraction']:.0f}%",
            f"{s['transfer_gb_per_s']:.3f}",
            f"{s['transfer_ratio_vs_memcpy']:.3f}",
        )
    console.print(table)


# ---------------------------------------------------------------------------------------------- main
def run(args: argparse.Namespace) -> dict[str, Any]:
    from dsv4rl.config.model_schema import ModelConfig
    from dsv4rl.model.model_dir import materialize_model

    mode = MODES["quick" if args.quick else "full"]
    started = time.monotonic()
    meta = run_meta(
        "weight_sync", "quick" if args.quick else "full", {k: v for k, v in mode.items() if k != "startup_s"}
    )
    with tempfile.TemporaryDirectory(prefix="dsv4rl-bench-") as tmp:
        model_dir = materialize_model(ModelConfig(init_seed=ENGINE_SEED), os.path.join(tmp, "tiny"))
        engines = Engines(Path(tmp), mode["sync_timeout_s"])
        try:
            tiny_port, synth_port = free_port(), free_port()
            engines.start(
                "tiny",
                [sys.executable, "-m", "dsv4rl.engine", "--model-path", model_dir, "--port", str(tiny_port)]
                + ["--num-threads", "1", "--random-seed", "0", "--log-level", "warning"],
                tiny_port,
            )
            engines.start(
                "synthetic",
                [sys.executable, __file__, "_serve", str(synth_port), model_dir]
                + [str(mode["synth_mib"]), str(mode["synth_tensor_side"])],
                synth_port,
            )
            # the engines start while this process builds the trainer-side sets and measures memcpy
            synth_named = list(
                synthetic(mode["synth_mib"], mode["synth_tensor_side"], seed=1).state_dict().items()
            )
            tiny_named = list(trainer_model(TRAINER_SEED).state_dict().items())
            urls = engines.wait_ready(mode["startup_s"])
            memcpy = measure_memcpy([t for _, t in synth_named], mode["memcpy_repeats"])
            syncs = []
            for set_name, named, url, buckets, repeats in [
                ("tiny", tiny_named, urls["tiny"], mode["tiny_buckets"], mode["tiny_repeats"]),
                ("synthetic", synth_named, urls["synthetic"], mode["synth_buckets"], mode["synth_repeats"]),
            ]:
                for load_format in ("per_tensor", FLAT):
                    for bucket_bytes in buckets:
                        syncs.append(
                            measure_sync(
                                url,
                                named,
                                set_name=set_name,
                                bucket_bytes=bucket_bytes,
                                load_format=load_format,
                                repeats=repeats,
                                timeout_s=mode["sync_timeout_s"],
                            )
                        )
        finally:
            engines.close()
    add_ratios(syncs, memcpy["gb_per_s"])
    meta["wall_seconds"] = time.monotonic() - started
    return {"meta": meta, "memcpy": memcpy, "syncs": syncs}


def main(argv: list[str] | None = None) -> int:
    return bench_main(
        __doc__, DEFAULT_OUT, "small sizes, one repeat: finishes in < 30 s", run, print_table, argv
    )


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "_serve":
        serve_synthetic(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        sys.exit(main())
