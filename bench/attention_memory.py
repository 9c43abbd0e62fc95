"""Peak memory and time of one Megatron attention layer, dense against sparse:
`python bench/attention_memory.py [--json] [--seq-lens 1024 2048 ...] [--dense-max 8192]`.

One sliding, one CSA and one HCA layer (DeepseekV4Attention with tiny head sizes and the release's
window 128, CSA ratio 4 with the indexer's top-512, HCA ratio 128), forward and backward of one sequence
of S tokens in float32. Peak memory is the allocator's: torch's profiler records every CPU allocation
and free (profile_memory), and the peak is the running sum's maximum over the step, above what was
allocated before it (weights and the input). Each row runs in a subprocess of its own, so one row's
allocations never shape another's (`--in-process`: one process, for quick checks); dense rows past
`--dense-max` are skipped (null). The plan's
activation model (`dsv4rl.estimate.attention`) is printed beside the measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

MB = 1 << 20
LAYER_TYPES = ("sliding", "csa", "hca")
HF_LAYER = {
    "sliding": "sliding_attention",
    "csa": "compressed_sparse_attention",
    "hca": "heavily_compressed_attention",
}
DEFAULT_SEQ_LENS = (1024, 2048, 4096, 8192, 16384)
QUICK_SEQ_LENS = (512, 1024, 2048)


def tiny_shape(query_chunk: int) -> dict:
    """The layer's dimensions: tiny heads, the release's window, ratios and top-k."""
    return {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "head_dim": 32,
        "qk_rope_head_dim": 16,
        "q_lora_rank": 32,
        "o_groups": 2,
        "o_lora_rank": 16,
        "sliding_window": 128,
        "csa_compress_rate": 4,
        "hca_compress_rate": 128,
        "index_n_heads": 2,
        "index_head_dim": 16,
        "index_topk": 512,
        "query_chunk": query_chunk,
    }


def measure(layer_type: str, seq_len: int, attention: str, query_chunk: int) -> dict:
    """In the child: peak MB above the baseline, and seconds, of one forward + backward."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from dsv4rl.config.choices import AttentionImpl
    from dsv4rl.config.model_schema import TinyModelConfig
    from dsv4rl.model.tiny import tiny_hf_config
    from dsv4rl.train.megatron import cpu_compat
    from dsv4rl.train.megatron.architecture import DeepseekV4Architecture, ParallelSizes, transformer_config
    from dsv4rl.train.megatron.attention import DeepseekV4Attention
    from dsv4rl.train.megatron.parallel import initialize
    from dsv4rl.train.megatron.rope import rotary_tables

    shape = tiny_shape(query_chunk)
    tiny = TinyModelConfig(
        **{k: v for k, v in shape.items() if k != "query_chunk"},
        num_hidden_layers=1,
        layer_types=[HF_LAYER[layer_type]],
        mlp_layer_types=["moe"],
        max_position_embeddings=max(seq_len, 1024),
    )
    sizes = ParallelSizes(attention=AttentionImpl(attention), attention_query_chunk=query_chunk)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
        initialize(sizes)
    hf_config = tiny_hf_config(tiny, vocab_size=64)
    arch = DeepseekV4Architecture.from_hf(hf_config)
    arch = type(arch)(**{**arch.__dict__, "attention": AttentionImpl(attention), "query_chunk": query_chunk})
    config = transformer_config(arch, sizes, torch.float32, on_cpu=cpu_compat.is_active())
    torch.manual_seed(0)
    layer = DeepseekV4Attention(config, arch, 0)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.normal_(0, 0.05)
    rope = torch.nn.ModuleDict(rotary_tables(hf_config))
    hidden = torch.randn(1, seq_len, arch.hidden_size, requires_grad=True)

    def step() -> None:
        out = layer(hidden, rope)
        out.float().pow(2).mean().backward()

    step()  # warm: the first call pays one-time allocations (thread pools, caches)
    layer.zero_grad(set_to_none=True)
    hidden.grad = None
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    layer.zero_grad(set_to_none=True)
    hidden.grad = None
    peak = running = 0
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    for event in sorted(events, key=lambda e: e.start_ns()):
        running += event.nbytes()
        peak = max(peak, running)
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    return {"peak_mb": peak / MB, "seconds": seconds}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_child(
    layer_type: str, seq_len: int, attention: str, query_chunk: int, timeout: float, in_process: bool = False
) -> dict | None:
    if in_process:
        return measure(layer_type, seq_len, attention, query_chunk)
    cmd = [sys.executable, __file__, "--child", layer_type, str(seq_len), attention, str(query_chunk)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return None
    if proc.returncode != 0:
        raise RuntimeError(f"{layer_type} S={seq_len} {attention} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def predicted_mb(layer_type: str, seq_len: int, attention: str, query_chunk: int) -> float:
    from dsv4rl.estimate.attention import AttentionShape, layer_peak_bytes

    s = tiny_shape(query_chunk)
    shape = AttentionShape(
        hidden=s["hidden_size"],
        heads=s["num_attention_heads"],
        head_dim=s["head_dim"],
        q_lora_rank=s["q_lora_rank"],
        o_lora_rank=s["o_lora_rank"],
        o_groups=s["o_groups"],
        window=s["sliding_window"],
        csa_ratio=s["csa_compress_rate"],
        hca_ratio=s["hca_compress_rate"],
        index_heads=s["index_n_heads"],
        index_head_dim=s["index_head_dim"],
        index_topk=s["index_topk"],
    )
    return layer_peak_bytes(shape, layer_type, seq_len, attention, query_chunk, value_bytes=4) / MB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=None)
    parser.add_argument("--dense-max", type=int, default=8192, help="longest S measured dense (default 8192)")
    parser.add_argument("--query-chunk", type=int, default=256)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per row")
    parser.add_argument("--quick", action="store_true", help=f"S in {QUICK_SEQ_LENS} (smoke runs)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="every row in this process (faster start; peaks are allocation events either way)",
    )
    parser.add_argument("--out", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args()
    if args.child:
        layer_type, seq_len, attention, chunk = args.child
        print(json.dumps(measure(layer_type, int(seq_len), attention, int(chunk))))
        return
    seq_lens = args.seq_lens or (QUICK_SEQ_LENS if args.quick else DEFAULT_SEQ_LENS)
    rows = []
    for layer_type in LAYER_TYPES:
        for seq_len in seq_lens:
            sparse = run_child(layer_type, seq_len, "sparse", args.query_chunk, args.timeout, args.in_process)
            dense = None
            if seq_len <= args.dense_max:
                dense = run_child(
                    layer_type, seq_len, "dense", args.query_chunk, args.timeout, args.in_process
                )
            row = {
                "layer_type": layer_type,
                "seq_len": seq_len,
                "dense_peak_mb": round(dense["peak_mb"], 2) if dense else None,
                "sparse_peak_mb": round(sparse["peak_mb"], 2) if sparse else None,
                "dense_s": round(dense["seconds"], 4) if dense else None,
                "sparse_s": round(sparse["seconds"], 4) if sparse else None,
                "dense_predicted_mb": round(predicted_mb(layer_type, seq_len, "dense", args.query_chunk), 2),
                "sparse_predicted_mb": round(
                    predicted_mb(layer_type, seq_len, "sparse", args.query_chunk), 2
                ),
                "query_chunk": args.query_chunk,
            }
            rows.append(row)
            if not args.json:
                print(_line(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    if args.json:
        print(json.dumps(rows, indent=1))


def _line(row: dict) -> str:
    def num(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    ratio = (
        f"{row['dense_peak_mb'] / row['sparse_peak_mb']:.1f}x"
        if row["dense_peak_mb"] and row["sparse_peak_mb"]
        else "-"
    )
    return (
        f"{row['layer_type']:8s} S={row['seq_len']:6d}  dense {num(row['dense_peak_mb'], '9.1f')} MB "
        f"(model {row['dense_predicted_mb']:9.1f}) {num(row['dense_s'], '7.3f')} s   sparse "
        f"{num(row['sparse_peak_mb'], '8.1f')} MB (model {row['sparse_predicted_mb']:8.1f}) "
        f"{num(row['sparse_s'], '7.3f')} s   dense/sparse peak {ratio}"
    )


if __name__ == "__main__":
    main()
