"""Weight sync of a >= 1 GiB state dict: bucketed vs raw broadcast vs one request per tensor; quantization.

    python bench/quant_sync.py [--quick] [--out bench/results/quant_sync.json]

Measures, in this order and in this process (rank 0 of every group), over gloo on loopback:
1. memcpy: `copy_` of the synthetic state dict into preallocated tensors (best of N);
2. raw broadcast: `torch.distributed.broadcast` of the same tensors to a peer process, in the same calls
   as the bucketed sync makes (one per tensor, all of a bucket in flight, bucket after bucket), the peer
   receiving into freshly allocated tensors as an engine does; no HTTP, no engine: the floor;
3. bucketed sync: `WeightSync.push` of the same tensors into a reference engine server whose receiver
   holds tensors of the same names, dtypes and shapes (256 MiB buckets: one request per bucket, the
   tensors broadcast one by one while it is in flight; also `flattened_bucket`, one broadcast per bucket);
4. per-tensor sync: the same push with one request per tensor (bucket_bytes=1);
5. quantization: `WireFormat.encode` of the whole state dict for bf16, fp8_rollout and fp8_mxfp4
   (seconds and input GB/s), and a bucketed push of the fp8_mxfp4 wire tensors into an engine that
   holds that format (quantize + send).
The synthetic state dict has DeepSeek-V4 native names (attention and shared-expert linears, routed
experts) with fp32 tensors of 1 MiB, as the tiny trainer holds them. Prints ratios measured in this run:
bucketed / raw broadcast (target >= 0.8), bucketed / per-tensor (target >= 3x), each against memcpy.
"""

from __future__ import annotations

import argparse
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

DEFAULT_OUT = ROOT / "bench" / "results" / "quant_sync.json"
GROUP = "bench_raw_broadcast"
SHAPE = (512, 512)  # fp32: 1 MiB
LAYER = (
    [f"attn.{m}.weight" for m in ("wq_a", "wkv", "wq_b", "wo_a", "wo_b")]
    + [f"ffn.shared_experts.w{i}.weight" for i in (1, 2, 3)]
    + [f"ffn.experts.{e}.w{i}.weight" for e in range(8) for i in (1, 2, 3)]
)  # 32 tensors per layer
MODES: dict[str, dict[str, Any]] = {
    "full": {
        "total_mib": 1024,
        "bucket_bytes": 256 * MIB,
        "repeats": 3,
        "startup_s": 180.0,
        "timeout_s": 300.0,
    },
    "quick": {"total_mib": 64, "bucket_bytes": 16 * MIB, "repeats": 1, "startup_s": 60.0, "timeout_s": 60.0},
}


def synthetic_names(total_mib: int) -> list[str]:
    count = total_mib * MIB // (SHAPE[0] * SHAPE[1] * 4)
    return [f"layers.{i // len(LAYER)}.{LAYER[i % len(LAYER)]}" for i in range(count)]


def synthetic_state(total_mib: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(SHAPE, generator=generator) * 0.02 for name in synthetic_names(total_mib)}


def wire_state(state: dict[str, torch.Tensor], mode: str) -> dict[str, torch.Tensor]:
    from dsv4rl.model.wire_format import WireFormat

    return WireFormat(mode).encode_all(state.items())


# ---------------------------------------------------------------------------------------------- children
def serve_engine(port: int, model_dir: str, total_mib: int, mode: str) -> None:
    """An engine server whose receiver holds the synthetic names in `mode`'s wire format."""
    import uvicorn

    from dsv4rl.engine.server import create_app
    from dsv4rl.engine.weight_receiver import WeightReceiver
    from dsv4rl.engine.weight_store import HeldWeights

    held = HeldWeights(wire_state(synthetic_state(total_mib, seed=0), mode), served=mode)
    app = create_app(model_dir, receiver=WeightReceiver(held), port=port, num_threads=1, random_seed=0)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=5)


def buckets_of(count: int, bucket_bytes: int) -> list[range]:
    """Index ranges of the tensors each bucket holds (all synthetic tensors have one size)."""
    per_bucket = max(1, bucket_bytes // (SHAPE[0] * SHAPE[1] * 4))
    return [range(start, min(start + per_bucket, count)) for start in range(0, count, per_bucket)]


def serve_peer(port: int, total_mib: int, bucket_bytes: int) -> None:
    """Rank 1 of the raw-broadcast group: on each `recv` line, receive every bucket into fresh memory."""
    import torch.distributed as dist

    from dsv4rl.wire.process_group import destroy_custom_process_group, init_custom_process_group

    group = init_custom_process_group(
        "gloo", f"tcp://127.0.0.1:{port}", world_size=2, rank=1, group_name=GROUP, timeout=300
    )
    buckets = buckets_of(len(synthetic_names(total_mib)), bucket_bytes)
    print("joined", flush=True)
    for line in sys.stdin:
        if line.strip() != "recv":
            break
        for bucket in buckets:
            received = [torch.empty(SHAPE) for _ in bucket]
            works = [dist.broadcast(t, src=0, group=group, async_op=True) for t in received]
            for work in works:
                work.wait()
            del received
        dist.barrier(group=group)
    destroy_custom_process_group(group)


# ---------------------------------------------------------------------------------------------- measure
def measure_raw(
    peer: Any, port: int, tensors: list[torch.Tensor], bucket_bytes: int, repeats: int
) -> dict[str, Any]:
    import torch.distributed as dist

    from dsv4rl.wire.process_group import destroy_custom_process_group, init_custom_process_group

    group = init_custom_process_group(
        "gloo", f"tcp://127.0.0.1:{port}", world_size=2, rank=0, group_name=GROUP, timeout=300
    )
    assert peer.stdout.readline().strip() == "joined"
    runs = []
    try:
        for _ in range(repeats):
            peer.stdin.write("recv\n")
            peer.stdin.flush()
            start = time.perf_counter()
            for bucket in buckets_of(len(tensors), bucket_bytes):
                works = [dist.broadcast(tensors[i], src=0, group=group, async_op=True) for i in bucket]
                for work in works:
                    work.wait()
            dist.barrier(group=group)  # the peer has every byte
            runs.append(time.perf_counter() - start)
    finally:
        peer.stdin.write("exit\n")
        peer.stdin.flush()
        destroy_custom_process_group(group)
    size = sum(t.numel() * t.element_size() for t in tensors)
    return {
        "bytes": size,
        "tensors": len(tensors),
        "bucket_bytes": bucket_bytes,
        "seconds": min(runs),
        "median_seconds": statistics.median(runs),
        "gb_per_s": size / min(runs) / 1e9,
        "runs_seconds": runs,
    }


def measure_push(
    url: str,
    named: list[tuple[str, torch.Tensor]],
    label: str,
    *,
    bucket_bytes: int,
    repeats: int,
    timeout_s: float,
    load_format: str = "per_tensor",
    wire_mode: str | None = None,
) -> dict[str, Any]:
    from dsv4rl.config.schema import SyncConfig
    from dsv4rl.engine_client.client import EngineClient
    from dsv4rl.model.wire_format import WireFormat
    from dsv4rl.sync.weight_sync import WeightSync

    cfg = SyncConfig(bucket_bytes=bucket_bytes, timeout_s=timeout_s)
    client = EngineClient(url, timeout_s=timeout_s, retries=0)
    wire = WireFormat(wire_mode) if wire_mode else None
    runs = []
    with WeightSync(
        [client], cfg, "gloo", "127.0.0.1", free_port(), load_format=load_format, wire_format=wire
    ) as sync:
        for i in range(repeats):
            runs.append(sync.push(named, f"bench-{label}-{i}"))
    best = min(runs, key=lambda s: s.seconds)
    return {
        "variant": label,
        "bucket_bytes": bucket_bytes,
        "format": "per_tensor_broadcast" if load_format == "per_tensor" else load_format,
        "wire": wire_mode or "as_is",
        "repeats": repeats,
        "bytes": best.bytes,
        "tensors": best.tensors,
        "buckets": best.buckets,
        "seconds": best.seconds,
        "median_seconds": statistics.median(s.seconds for s in runs),
        "transfer_seconds": best.transfer_seconds,
        "pipeline_seconds": best.pipeline_seconds,
        "control_seconds": best.control_seconds,
        "gb_per_s": best.gb_per_s,
    }


def measure_quantization(state: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    from dsv4rl.model.wire_format import WireFormat

    size = sum(t.numel() * t.element_size() for t in state.values())
    out = []
    for mode in ("bf16", "fp8_rollout", "fp8_mxfp4"):
        wire = WireFormat(mode)
        start = time.perf_counter()
        wire_bytes = 0
        for name, tensor in state.items():
            wire_bytes += sum(t.numel() * t.element_size() for _, t in wire.encode(name, tensor))
        seconds = time.perf_counter() - start
        out.append(
            {
                "mode": mode,
                "input_bytes": size,
                "wire_bytes": wire_bytes,
                "seconds": seconds,
                "input_gb_per_s": size / seconds / 1e9,
            }
        )
    return out


# ---------------------------------------------------------------------------------------------- main
def run(args: argparse.Namespace) -> dict[str, Any]:
    from dsv4rl.config.model_schema import ModelConfig
    from dsv4rl.model.model_dir import materialize_model

    mode_name = "quick" if args.quick else "full"
    mode = MODES[mode_name]
    started = time.monotonic()
    meta = run_meta("quant_sync", mode_name, {k: v for k, v in mode.items() if k != "startup_s"})
    total = mode["total_mib"]
    with tempfile.TemporaryDirectory(prefix="dsv4rl-bench-") as tmp:
        model_dir = materialize_model(ModelConfig(), str(Path(tmp) / "tiny"))
        engines = Engines(Path(tmp), mode["timeout_s"])
        try:
            ports = {"plain": free_port(), "mxfp4": free_port(), "peer": free_port()}
            for name, wire in (("plain", "none"), ("mxfp4", "fp8_mxfp4")):
                engines.start(
                    name,
                    [sys.executable, __file__, "_engine", str(ports[name]), model_dir, str(total), wire],
                    ports[name],
                )
            import subprocess

            peer = engines.start(
                "peer",
                [
                    sys.executable,
                    __file__,
                    "_peer",
                    str(ports["peer"]),
                    str(total),
                    str(mode["bucket_bytes"]),
                ],
                ports["peer"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            state = synthetic_state(total, seed=1)
            named = list(state.items())
            tensors = [t for _, t in named]
            urls = engines.wait_ready(mode["startup_s"], ["plain", "mxfp4"])
            memcpy = measure_memcpy(tensors, 3)
            raw = measure_raw(peer, ports["peer"], tensors, mode["bucket_bytes"], mode["repeats"])
            common = {"repeats": mode["repeats"], "timeout_s": mode["timeout_s"]}
            bucketed = measure_push(
                urls["plain"], named, "bucketed", bucket_bytes=mode["bucket_bytes"], **common
            )
            flattened = measure_push(
                urls["plain"],
                named,
                "bucketed_flattened",
                bucket_bytes=mode["bucket_bytes"],
                load_format="flattened_bucket",
                **common,
            )
            per_tensor = measure_push(
                urls["plain"], named, "per_tensor", bucket_bytes=1, repeats=1, timeout_s=mode["timeout_s"]
            )
            quantization = measure_quantization(state)
            mxfp4 = measure_push(
                urls["mxfp4"],
                named,
                "bucketed_fp8_mxfp4",
                bucket_bytes=mode["bucket_bytes"],
                wire_mode="fp8_mxfp4",
                **common,
            )
        finally:
            engines.close()
    ratios = {
        "bucketed_vs_raw_broadcast": bucketed["gb_per_s"] / raw["gb_per_s"],
        "bucketed_vs_per_tensor": bucketed["gb_per_s"] / per_tensor["gb_per_s"],
        "flattened_vs_raw_broadcast": flattened["gb_per_s"] / raw["gb_per_s"],
        "raw_broadcast_vs_memcpy": raw["gb_per_s"] / memcpy["gb_per_s"],
        "bucketed_vs_memcpy": bucketed["gb_per_s"] / memcpy["gb_per_s"],
    }
    meta["wall_seconds"] = time.monotonic() - started
    return {
        "meta": meta,
        "memcpy": memcpy,
        "raw_broadcast": raw,
        "syncs": [bucketed, flattened, per_tensor, mxfp4],
        "quantization": quantization,
        "ratios": ratios,
        "targets": {"bucketed_vs_raw_broadcast": 0.8, "bucketed_vs_per_tensor": 3.0},
    }


def print_report(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    meta = result["meta"]
    table = Table(
        title=(
            f"weight sync of {fmt_bytes(result['memcpy']['bytes'])} over gloo/loopback ({meta['mode']}; "
            f"torch {meta['torch']}, {meta['cpu_count']} CPUs)"
        )
    )
    for column in ("what", "requests", "seconds", "GB/s", "x raw broadcast", "x memcpy"):
        table.add_column(column, justify="left" if column == "what" else "right")
    raw, mem = result["raw_broadcast"]["gb_per_s"], result["memcpy"]["gb_per_s"]
    table.add_row("memcpy", "-", f"{result['memcpy']['seconds']:.3f}", f"{mem:.2f}", f"{mem / raw:.2f}", "1")
    table.add_row(
        "raw broadcast",
        "-",
        f"{result['raw_broadcast']['seconds']:.3f}",
        f"{raw:.2f}",
        "1",
        f"{raw / mem:.3f}",
    )
    for s in result["syncs"]:
        table.add_row(
            f"{s['variant']} ({s['format']}, wire {s['wire']})",
            str(s["buckets"]),
            f"{s['seconds']:.3f}",
            f"{s['gb_per_s']:.3f}",
            f"{s['gb_per_s'] / raw:.2f}",
            f"{s['gb_per_s'] / mem:.3f}",
        )
    console.print(table)
    quant = Table(title="quantize on send (WireFormat.encode of the whole state dict)")
    for column in ("mode", "seconds", "input GB/s", "wire MiB"):
        quant.add_column(column, justify="left" if column == "mode" else "right")
    for q in result["quantization"]:
        quant.add_row(
            q["mode"], f"{q['seconds']:.2f}", f"{q['input_gb_per_s']:.3f}", f"{q['wire_bytes'] / MIB:.0f}"
        )
    console.print(quant)
    for key, target in result["targets"].items():
        value = result["ratios"][key]
        console.print(
            f"{key}: {value:.2f} (target >= {target:g}) {'ok' if value >= target else 'BELOW TARGET'}"
        )


def main(argv: list[str] | None = None) -> int:
    return bench_main(
        __doc__, DEFAULT_OUT, "64 MiB, one repeat (the smoke test runs this)", run, print_report, argv
    )


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "_engine":
        serve_engine(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5])
    elif len(sys.argv) == 5 and sys.argv[1] == "_peer":
        serve_peer(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    else:
        sys.exit(main())
