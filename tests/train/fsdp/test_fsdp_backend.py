"""FSDPBackend under torchrun with gloo, world 1 and 2 (run concurrently, once per module)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fsdp_scenarios import check_nonfinite
from transformers import DeepseekV4ForCausalLM

from dsv4rl.model.tokenizer import build_char_tokenizer
from free_ports import free_port

SCRIPT = Path(__file__).with_name("fsdp_scenarios.py")
TIMEOUT_S = 180


def launch(world: int, out: Path, *extra: str) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(world),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(SCRIPT),
        str(out),
        *extra,
    ]
    # own session: on timeout the whole tree (torchrun and its workers) is killed
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def kill_tree(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_both(procs: dict[int, subprocess.Popen], result: str) -> dict[int, dict]:
    """Wait for both worlds' runs, each bounded by TIMEOUT_S; load the `result` file each wrote."""
    out = {}
    try:
        for w, proc in procs.items():
            try:
                log, _ = proc.communicate(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"world {w} run exceeded {TIMEOUT_S}s")
            assert proc.returncode == 0, f"world {w} failed:\n{log[-6000:]}"
            directory = Path(proc.args[-1] if result == "results" else proc.args[-3])
            out[w] = torch.load(directory / f"{result}_world{w}.pt", weights_only=False)
            out[w]["dir"] = directory
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                kill_tree(proc)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[int, dict]:
    """Both worlds run concurrently (a single-threaded import dominates)."""
    root = tmp_path_factory.mktemp("fsdp")
    return run_both({w: launch(w, root / f"w{w}") for w in (1, 2)}, "results")


@pytest.fixture(scope="module")
def resumed(results) -> dict[int, dict]:
    """World 1 resumes from world 2's checkpoint and world 2 from world 1's, concurrently."""
    other = {1: 2, 2: 1}
    procs = {w: launch(w, results[w]["dir"], "--resume-from", str(results[other[w]]["dir"])) for w in (1, 2)}
    return run_both(procs, "resumed")


@pytest.mark.parametrize("world", [1, 2])
def test_logprobs_match_unsharded_model(results, world):
    r = results[world]
    model = DeepseekV4ForCausalLM.from_pretrained(r["dir"] / "model", dtype=torch.float32).eval()
    ids = r["batch_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    expected = torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, ids[:, 1:, None])[..., 0].float()
    assert r["logprobs"].shape == expected.shape
    assert (r["logprobs"] - expected).abs().max() < 1e-5
    assert max(r["uneven_diffs"]) < 1e-5  # different batch sizes per rank: no deadlock, same values


@pytest.mark.parametrize("world", [1, 2])
def test_positive_advantage_raises_sequence_logprob(results, world):
    r = results[world]
    mask = r["mask"]
    before = (r["logprobs"] * mask).sum(1)
    after = (r["logprobs_after"] * mask).sum(1)
    assert after[0] > before[0] + 1e-3, (before[0], after[0])


def test_world2_update_equals_world1(results):
    w1, w2 = results[1]["full_weights"], results[2]["full_weights"]
    assert w1.keys() == w2.keys()
    worst = max((w1[k].double() - w2[k].double()).abs().max().item() for k in w1)
    assert worst < 1e-5
    moved = max((w1[k].double() - results[1]["initial_weights"][k].double()).abs().max().item() for k in w1)
    assert moved > 1e-4  # the comparison is not vacuous
    for m1, m2 in zip(results[1]["full_metrics"], results[2]["full_metrics"], strict=True):
        keys = ("loss", "grad_norm", "kl", "entropy", "clipfrac", "lr", "logprob_abs_diff",
                "tis_clip_fraction", "mis_masked_fraction")  # fmt: skip
        for key in keys:
            assert m1[key] == pytest.approx(m2[key], rel=1e-4, abs=1e-6), key
    first, second = results[1]["full_metrics"]
    assert 0.0 < first["mis_masked_fraction"] < 1.0 and first["tis_clip_fraction"] == 0.0
    # warmup over 4 optimizer steps, 2 per train_step; lr reported is the last update's
    assert first["lr"] == pytest.approx(5e-4) and second["lr"] == pytest.approx(1e-3)
    assert first["grad_norm"] > 0.5  # clipping was active
    assert first["logprob_abs_diff"] > 0 and first["entropy"] > 0 and second["kl"] > 0


@pytest.mark.parametrize("world", [1, 2])
def test_one_update_per_batch_reuses_the_training_forward(results, world):
    """With algo.updates_per_step=1 the old log-probs come from the training forward itself: after 3
    steps (KL, entropy, TIS, MIS on) the weights and metrics equal those of the separate old-policy pass."""
    (reused, reused_metrics, reused_forwards), (separate, separate_metrics, separate_forwards) = (
        results[world]["on_policy_True"],
        results[world]["on_policy_False"],
    )
    assert separate_forwards == 2 * reused_forwards > 0  # one policy forward per micro-batch, not two
    assert max((reused[k].double() - separate[k].double()).abs().max().item() for k in reused) < 1e-6
    for a, b in zip(reused_metrics, separate_metrics, strict=True):
        for key in ("loss", "grad_norm", "kl", "entropy", "logprob_abs_diff", "mis_masked_fraction"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    assert 0.0 < reused_metrics[0]["mis_masked_fraction"] < 1.0 and reused_metrics[0]["logprob_abs_diff"] > 0


def test_named_weights_for_sync_full_tensors_on_rank0(results):
    r1, r2 = results[1], results[2]
    assert r2["yield_counts"][1] == 0 and r2["yield_counts"][0] == len(r2["initial_weights"])
    plain = DeepseekV4ForCausalLM.from_pretrained(r2["dir"] / "model", dtype=torch.float32).state_dict()
    init = r2["initial_weights"]
    assert list(init) == list(plain)  # HF names: every parameter and persistent buffer, same order
    assert not any("inv_freq" in k for k in init)
    for k, v in init.items():
        assert v.dtype == plain[k].dtype and torch.equal(v, plain[k]), k
    tid = init["model.layers.0.mlp.gate.tid2eid"]
    assert tid.dtype == torch.int64 and tid.shape == (len(build_char_tokenizer()), 2) and tid.max() > 0
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in init
    for k in init:
        assert torch.equal(r1["initial_weights"][k], init[k])


@pytest.mark.parametrize("world", [1, 2])
def test_checkpoint_resume_is_exact(results, world):
    r = results[world]
    a, b = r["ckpt_weights_a"], r["ckpt_weights_b"]
    assert a.keys() == b.keys()
    assert max((a[k].double() - b[k].double()).abs().max().item() for k in a) < 1e-6
    assert r["lrs"][0] == r["lrs"][1] == pytest.approx([7.5e-4, 1e-3])  # scheduler restored mid-warmup
    assert r["loaded_step"] == 2
    assert [flag for flag, _ in r["per_rank_restore"]] == [True] * world
    assert [extra for _, extra in r["per_rank_restore"]] == [{"cursor": 101, "rank": i} for i in range(world)]
    # keep_checkpoints=2 pruned step 1; nothing half-written remains; latest is the newest
    assert r["ckpt_listing"] == ["step_00000002", "step_00000004"]
    assert Path(r["latest"]).name == "step_00000004"


def test_one_rank_keeps_a_plain_module_and_two_ranks_shard_it(results):
    assert results[1]["sharded"] is False
    assert results[2]["sharded"] is True


def test_a_checkpoint_resumes_at_the_other_world_size(results, resumed):
    """Distributed checkpointing stores whole tensors by global offsets: a plain module's checkpoint
    loads into a sharded one and the other way round, optimizer state included."""
    for world, other in ((1, 2), (2, 1)):
        crossed, own = resumed[world]["other"], resumed[world]["own"]
        saved = results[other]["ckpt_weights_a"]  # the weights of the other world's step-4 checkpoint
        assert saved.keys() == crossed["loaded"].keys()
        for name in saved:
            assert torch.equal(saved[name], crossed["loaded"][name]), (world, name)
        assert crossed["step"] == 4 and crossed["extra"]["cursor"] == 103
        assert crossed["metrics"]["lr"] == own["metrics"]["lr"]
        # One step of the same batch, from weights 1e-6 apart, moves both alike: Adam's moments came
        # back (a fresh optimizer's first step would differ by about lr, 1e-3); measured within 3e-5
        for name in saved:
            moved = crossed["trained"][name] - crossed["loaded"][name]
            reference = own["trained"][name] - own["loaded"][name]
            torch.testing.assert_close(moved, reference, atol=1e-4, rtol=0, msg=f"world {world}: {name}")


@pytest.mark.parametrize("world", [1, 2])
def test_nonfinite_steps_are_skipped_then_stop_naming_the_tensor(results, world):
    check_nonfinite(results[world]["nonfinite"], world)
