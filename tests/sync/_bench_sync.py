"""WeightSync throughput over gloo on loopback: `python tests/sync/_bench_sync.py` (not a test).

Pushes the tiny model into a real reference engine, then a synthetic 256 MB tensor set into an engine
whose WeightReceiver targets a module of the same tensors; prints SyncStats per configuration.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import torch

from dsv4rl.config.schema import ModelConfig, SyncConfig
from dsv4rl.model.tiny import materialize_model

sys.path.insert(0, os.path.dirname(__file__))
from sync_helpers import free_port, trainer_model  # noqa: E402

SYNTH_TENSORS = 64  # x 4 MiB = 256 MiB


def synthetic(seed: int) -> torch.nn.Module:
    module = torch.nn.Module()
    gen = torch.Generator().manual_seed(seed)
    for i in range(SYNTH_TENSORS):
        module.register_buffer(f"w{i}", torch.randn(1024, 1024, generator=gen))
    return module


def serve(port: int, model_dir: str, synth: bool) -> None:
    import uvicorn

    from dsv4rl.engine.server import create_app
    from dsv4rl.engine.weight_receiver import WeightReceiver

    receiver = WeightReceiver(synthetic(0)) if synth else None
    app = create_app(model_dir, receiver=receiver, port=port, num_threads=1, random_seed=0)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def bench(url: str, named: list, label: str, bucket_bytes: int, load_format=None, naming="native", repeats=3):
    from dsv4rl.rollout.client import EngineClient
    from dsv4rl.sync.weight_sync import WeightSync

    cfg = SyncConfig(bucket_bytes=bucket_bytes, naming=naming, timeout_s=120)
    runs = []
    with WeightSync(
        [EngineClient(url)], cfg, "gloo", "127.0.0.1", free_port(), load_format=load_format
    ) as sync:
        for i in range(repeats):
            runs.append(sync.push(named, f"{label}-{i}"))
    best = min(runs, key=lambda s: s.seconds)
    median = statistics.median(s.seconds for s in runs)
    print(
        f"{label:<44} {best.bytes / 2**20:8.1f} MiB  {best.tensors:4d} tensors  {best.buckets:3d} buckets  "
        f"best {best.seconds:6.3f} s ({best.gb_per_s:5.2f} GB/s; "
        f"transfer {best.transfer_gb_per_s:5.2f} GB/s)  "
        f"median {median:6.3f} s",
        flush=True,
    )


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = materialize_model(ModelConfig(init_seed=11), os.path.join(tmp, "tiny"))
        for synth in (False, True):
            port = free_port()
            proc = subprocess.Popen(
                [sys.executable, __file__, "serve", str(port), model_dir, str(int(synth))]
            )
            url = f"http://127.0.0.1:{port}"
            try:
                for _ in range(600):
                    try:
                        if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    time.sleep(0.2)
                if synth:
                    named = list(synthetic(1).state_dict().items())
                    for mib in (16, 64, 1024):
                        bench(url, named, f"synthetic 256 MiB, {mib} MiB buckets", mib << 20, naming="hf")
                        bench(
                            url,
                            named,
                            f"synthetic 256 MiB, {mib} MiB flattened",
                            mib << 20,
                            "flattened_bucket",
                            "hf",
                        )
                else:
                    named = list(trainer_model(22).state_dict().items())
                    bench(url, named, "tiny model, 1 GiB bucket", 1 << 30, repeats=5)
                    bench(url, named, "tiny model, 1 GiB flattened", 1 << 30, "flattened_bucket", repeats=5)
                    bench(url, named, "tiny model, 32 KiB buckets", 32 << 10, repeats=5)
            finally:
                proc.terminate()
                proc.wait(timeout=30)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        serve(int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1")
    else:
        main()
