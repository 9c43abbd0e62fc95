"""DeepSeek-V4 in megatron-core against transformers' DeepseekV4ForCausalLM with the same weights, and
its TP=2, PP=2 and EP=2 layouts against world size 1 (torchrun, gloo; scenarios.py does the work).

Three configs: `tiny` (48 tokens; the indexer keeps every entry), `every_type` (6 layers, each kind
twice; top-4 of up to 12 entries), `selecting` (160 tokens = 20 sliding windows of 8; the indexer keeps
8 of up to 40 CSA entries; HCA at ratio 16; two of the four rows right-padded to 131 and 97 tokens).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).with_name("scenarios.py")
TIMEOUT_S = 240
CONFIGS = ("tiny", "every_type", "selecting")
# (tensor, pipeline, expert, last stage layers): tiny and selecting have 3 layers, PP=2 puts 1 on the last
LAYOUTS = {"tp2": (2, 1, 1, None), "pp2": (1, 2, 1, 1), "ep2": (1, 1, 2, None)}
LAYOUT_CONFIGS = ("tiny", "selecting")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: Path, world: int, args: list[str]) -> subprocess.Popen:
    """torchrun `script` on `world` processes in its own session (a timeout kills the whole tree)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world)]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", str(_free_port()), str(script), *args]
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def _launch(
    out: Path,
    config: str,
    tensor: int,
    pipeline: int,
    expert: int,
    last: int | None,
    dtype: str = "float32",
    *extra: str,
) -> subprocess.Popen:
    args = [str(out), config, str(tensor), str(pipeline), str(expert)] + ([str(last)] if last else [])
    return launch(SCRIPT, tensor * pipeline * expert, [*args, "--dtype", dtype, *extra])


def collect(procs: dict[str, tuple[subprocess.Popen, Path]]) -> dict[str, dict]:
    out = {}
    try:
        for name, (proc, path) in procs.items():
            try:
                log, _ = proc.communicate(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name} exceeded {TIMEOUT_S}s")
            assert proc.returncode == 0, f"{name} failed:\n{log[-6000:]}"
            out[name] = torch.load(path, weights_only=False)
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return out


@pytest.fixture(scope="module")
def world_one(tmp_path_factory) -> dict[str, dict]:
    """Every config at world size 1, concurrently (one process each)."""
    root = tmp_path_factory.mktemp("megatron_w1")
    return collect({c: (_launch(root / f"{c}.pt", c, 1, 1, 1, None), root / f"{c}.pt") for c in CONFIGS})


@pytest.fixture(scope="module")
def two_process(tmp_path_factory) -> Callable[[str, str], dict]:
    """(config, layout) -> that run at TP=2, PP=2 or EP=2 (2 processes), run once when first asked."""
    root = tmp_path_factory.mktemp("megatron_w2")
    runs: dict[tuple[str, str], dict] = {}

    def run(config: str, layout: str) -> dict:
        if (config, layout) not in runs:
            path = root / f"{config}_{layout}.pt"
            runs[config, layout] = collect({layout: (_launch(path, config, *LAYOUTS[layout]), path)})[layout]
        return runs[config, layout]

    return run


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = float(b.norm())
    return float((a - b).norm()) / scale if scale > 0 else float(a.norm())


@pytest.mark.parametrize("config", CONFIGS)
def test_logprobs_match_transformers(world_one, config):
    result = world_one[config]
    assert result["logprobs"].shape == result["reference_logprobs"].shape
    assert (result["logprobs"] - result["reference_logprobs"]).abs().max() < 1e-4


@pytest.mark.parametrize("config", CONFIGS)
def test_gradients_match_transformers(world_one, config):
    result = world_one[config]
    assert set(result["grads"]) == set(result["reference_grads"])
    worst = {name: _relative(result["grads"][name], ref) for name, ref in result["reference_grads"].items()}
    assert max(worst.values()) < 1e-4, sorted(worst.items(), key=lambda kv: -kv[1])[:5]


@pytest.mark.parametrize("config", CONFIGS)
def test_every_tensor_is_mapped_and_round_trips(world_one, config):
    """Loading transformers' state into Megatron and gathering it back gives every tensor, bit for bit
    (tid2eid stays integer)."""
    result = world_one[config]
    reference, exported = result["reference_state"], result["weights"]
    assert set(exported) == set(reference)
    for name, tensor in reference.items():
        assert exported[name].dtype == tensor.dtype, name
        assert torch.equal(exported[name], tensor), name


def test_top_k_selection_happens(world_one):
    """`selecting` reaches the paths the short configs skip: at the longest position the CSA indexer
    chooses `index_topk` of many more visible entries, HCA compresses 16 tokens an entry, the sequence
    spans many sliding windows; and its choices are decided by margins far above float32 noise (two
    float32 runs of the same scores differ by ~3e-7), so every layout must make the same ones."""
    result = world_one["selecting"]
    indexers = [r for r in result["compression"].values() if r["kind"] == "indexer"]
    assert indexers
    for record in indexers:
        assert record["topk"] < record["entries"] == 160 // record["ratio"], record
        assert record["selected"] == record["topk"], record
    hca = [r for r in result["compression"].values() if r["kind"] == "compressor" and r["ratio"] >= 16]
    assert hca and all(r["entries"] == 160 // r["ratio"] for r in hca), result["compression"]
    assert result["logprobs"].shape[1] + 1 >= 20 * 8  # 20 windows of the tiny configs' 8
    assert result["top_k_margin"] is not None and result["top_k_margin"] > 1e-6


def test_right_padded_rows_equal_the_rows_alone(world_one):
    """Two rows are right-padded (to 131 and 97 real tokens: CSA and HCA windows end mid-row): their
    real tokens' log-probs equal transformers' on the row alone, unpadded."""
    result = world_one["selecting"]
    assert sorted(result["reference_unpadded"]) == [2, 3]
    for row, alone in result["reference_unpadded"].items():
        assert alone.shape[0] == result["lengths"][row] - 1
        assert (result["logprobs"][row, : alone.shape[0]] - alone).abs().max() < 1e-4, row


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("config", LAYOUT_CONFIGS)
def test_parallel_layout_equals_world_one(world_one, two_process, config, layout):
    single, parallel = world_one[config], two_process(config, layout)
    # every stage's compressors and indexers ran, with the same entry and selection counts
    assert parallel["compression"] == single["compression"]
    assert (parallel["logprobs"] - single["logprobs"]).abs().max() < 1e-5
    assert abs(parallel["loss"] - single["loss"]) <= 1e-5 * abs(single["loss"])
    worst = {name: _relative(parallel["grads"][name], grad) for name, grad in single["grads"].items()}
    assert max(worst.values()) < 1e-4, sorted(worst.items(), key=lambda kv: -kv[1])[:5]
    for name, tensor in single["weights"].items():
        assert torch.equal(parallel["weights"][name], tensor), name


@pytest.fixture(scope="module")
def dense_and_chunked(tmp_path_factory) -> dict[str, dict]:
    """`selecting` with the dense reference attention at TP=1 and TP=2, and the sparse one at TP=2 in
    query chunks of 48 (4 chunks of a 160-token row; the indexer scores in the same chunks)."""
    root = tmp_path_factory.mktemp("megatron_attention")
    runs = {
        "dense_tp1": (1, ["--attention", "dense"]),
        "dense_tp2": (2, ["--attention", "dense"]),
        "chunked_tp2": (2, ["--query-chunk", "48"]),
    }
    return collect(
        {
            name: (
                _launch(root / f"{name}.pt", "selecting", tp, 1, 1, None, "float32", *extra),
                root / f"{name}.pt",
            )
            for name, (tp, extra) in runs.items()
        }
    )


@pytest.mark.slow
def test_sparse_attention_equals_the_dense_reference(world_one, dense_and_chunked):
    """The default (sparse, one chunk) at TP=1 and the sparse in 4 chunks at TP=2 against the dense form at
    the same layout: log-probs within 1e-6, every gradient within 1e-5 relative, the same selections."""
    pairs = [
        (world_one["selecting"], dense_and_chunked["dense_tp1"]),
        (dense_and_chunked["chunked_tp2"], dense_and_chunked["dense_tp2"]),
    ]
    for sparse, dense in pairs:
        assert sparse["compression"] == dense["compression"]
        assert (sparse["logprobs"] - dense["logprobs"]).abs().max() < 1e-6
        worst = {name: _relative(sparse["grads"][name], grad) for name, grad in dense["grads"].items()}
        assert max(worst.values()) < 1e-5, sorted(worst.items(), key=lambda kv: -kv[1])[:5]
