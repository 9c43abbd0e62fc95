"""DeepSeek-V4 in megatron-core against transformers' DeepseekV4ForCausalLM with the same weights, and
its TP=2, PP=2 and EP=2 layouts against world size 1 (torchrun, gloo; scenarios.py does the work)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).with_name("scenarios.py")
TIMEOUT_S = 240
CONFIGS = ("tiny", "every_type")
# (tensor, pipeline, expert, last stage layers): the tiny model has 3 layers, so PP=2 puts 1 on the last
LAYOUTS = {"tp2": (2, 1, 1, None), "pp2": (1, 2, 1, 1), "ep2": (1, 1, 2, None)}


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
    out: Path, config: str, tensor: int, pipeline: int, expert: int, last: int | None
) -> subprocess.Popen:
    args = [str(out), config, str(tensor), str(pipeline), str(expert)] + ([str(last)] if last else [])
    return launch(SCRIPT, tensor * pipeline * expert, args)


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
    """Both configs at world size 1, concurrently (one process each)."""
    root = tmp_path_factory.mktemp("megatron_w1")
    return collect({c: (_launch(root / f"{c}.pt", c, 1, 1, 1, None), root / f"{c}.pt") for c in CONFIGS})


@pytest.fixture(scope="module")
def two_process(tmp_path_factory) -> dict[str, dict]:
    """The tiny model at TP=2, PP=2 and EP=2, one layout after the other (2 processes each)."""
    root = tmp_path_factory.mktemp("megatron_w2")
    out = {}
    for name, layout in LAYOUTS.items():
        path = root / f"{name}.pt"
        out.update(collect({name: (_launch(path, "tiny", *layout), path)}))
    return out


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


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_parallel_layout_equals_world_one(world_one, two_process, layout):
    single, parallel = world_one["tiny"], two_process[layout]
    assert (parallel["logprobs"] - single["logprobs"]).abs().max() < 1e-5
    assert abs(parallel["loss"] - single["loss"]) <= 1e-5 * abs(single["loss"])
    worst = {name: _relative(parallel["grads"][name], grad) for name, grad in single["grads"].items()}
    assert max(worst.values()) < 1e-4, sorted(worst.items(), key=lambda kv: -kv[1])[:5]
    for name, tensor in single["weights"].items():
        assert torch.equal(parallel["weights"][name], tensor), name
