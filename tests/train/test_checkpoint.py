"""Checkpoint helpers without a process group (DCP runs single-process)."""

from __future__ import annotations

import logging
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dsv4rl.train.checkpoint import (
    CheckpointUnreadable,
    checkpoint_dir,
    latest_checkpoint,
    load_checkpoint,
    load_newest,
    prune_checkpoints,
    save_checkpoint,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def make(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model.register_buffer("table", torch.arange(6).view(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, optimizer, {"step": 0, "updates": 0}


def train(model, optimizer, counters, steps: int, seed: int) -> None:
    """`steps` optimizer steps at a warmup learning rate set from the counters, as the update loop does."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        loss = model(torch.randn(5, 4, generator=g)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        for group in optimizer.param_groups:
            group["lr"] = 0.1 * min(1.0, (counters["updates"] + 1) / 4)
        optimizer.step()
        counters["updates"] += 1
    counters["step"] += 1


def test_save_load_resume_exact(tmp_path):
    model, opt, counters = make(0)
    train(model, opt, counters, 2, seed=1)
    with torch.no_grad():
        model.table += 10
    random.seed(3)
    path = save_checkpoint(checkpoint_dir(tmp_path, 1), model, opt, counters, extra_state={"cursor": 7})
    draw = random.random()
    train(model, opt, counters, 2, seed=2)
    fresh, opt2, _ = make(5)
    random.seed(0)
    np.random.seed(0)
    loaded, extra = load_checkpoint(path, fresh, opt2)
    assert (loaded, extra) == ({"step": 1, "updates": 2}, {"cursor": 7})
    assert random.random() == draw
    assert torch.equal(fresh.table, torch.arange(6).view(3, 2) + 10)
    train(fresh, opt2, loaded, 2, seed=2)
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert loaded == counters
    assert not list(tmp_path.glob("*.tmp"))


def test_a_checkpoint_with_a_scheduler_state_resumes_its_position(tmp_path):
    """Checkpoints written before the counters kept torch's LambdaLR state: its position is the updates."""
    model, opt, counters = make(0)
    path = save_checkpoint(checkpoint_dir(tmp_path, 3), model, opt, {"step": 3})
    state = torch.load(path / "trainer_state.pt", weights_only=False)
    state["scheduler"] = {"last_epoch": 6, "base_lrs": [0.1]}
    torch.save(state, path / "trainer_state.pt")
    assert load_checkpoint(path, *make(1)[:2])[0] == {"step": 3, "updates": 6}


def test_latest_prune_and_incomplete(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(tmp_path / "missing") is None
    model, opt, _ = make(0)
    for step in (1, 2, 10):
        save_checkpoint(checkpoint_dir(tmp_path, step), model, opt, {"step": step})
    (tmp_path / "step_00000099.tmp").mkdir()  # half-written: ignored
    (tmp_path / "step_00000050").mkdir()  # no trainer_state.pt: incomplete, ignored
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 10)
    save_checkpoint(checkpoint_dir(tmp_path, 11), model, opt, {"step": 11}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir() if (p / "trainer_state.pt").exists()) == [
        "step_00000010",
        "step_00000011",
    ]
    assert prune_checkpoints(tmp_path, 0) == []
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        load_checkpoint(tmp_path / "step_00000050", model, opt)


def test_load_rejects_other_model(tmp_path):
    model, opt, counters = make(0)
    train(model, opt, counters, 1, seed=1)
    path = save_checkpoint(tmp_path / "step_00000001", model, opt, counters)
    other = torch.nn.Linear(4, 2)
    other_opt = torch.optim.AdamW(other.parameters())
    with pytest.raises(ValueError, match="lacks model tensors"):
        load_checkpoint(path, other, other_opt)


def test_failed_save_leaves_no_checkpoint(tmp_path):
    model, opt, _ = make(0)
    with pytest.raises(Exception):  # noqa: B017 - whatever pickling raises
        save_checkpoint(checkpoint_dir(tmp_path, 3), model, opt, {"step": 3}, extra_state={"f": lambda: 0})
    assert not checkpoint_dir(tmp_path, 3).exists()
    assert latest_checkpoint(tmp_path) is None
    save_checkpoint(checkpoint_dir(tmp_path, 3), model, opt, {"step": 3})  # the stale .tmp is replaced
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 3)
    assert not list(tmp_path.glob("*.tmp"))


_THREADS_SCRIPT = """
import os, sys, torch, torch.distributed as dist
from dsv4rl.train.checkpoint import checkpoint_dir, save_checkpoint
torch.set_num_threads(2)
dist.init_process_group("gloo", rank=0, world_size=1, init_method="file://" + sys.argv[1] + "/store")
model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(300)])  # a plan of many entries
optimizer = torch.optim.AdamW(model.parameters())
model(torch.randn(2, 8)).sum().backward()
optimizer.step()
torch.randn(1 << 20).exp()  # the main thread's OpenMP team exists before the save
before = len(os.listdir("/proc/self/task"))
save_checkpoint(checkpoint_dir(sys.argv[1], 1), model, optimizer, {"step": 1})
print(before, len(os.listdir("/proc/self/task")))
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_save_leaves_no_openmp_threads_behind(tmp_path):
    """Gloo copies a collective's tensors on its worker threads, and each of them that runs a parallel op
    keeps an OpenMP team for good; with more OpenMP threads than cores libgomp stops spinning and every
    later training op sleeps and wakes (2-thread train steps 30-60 % slower). The save's collectives run
    on a group of their own, destroyed after it, so the process has as many threads after as before."""
    run = subprocess.run(
        [sys.executable, "-c", _THREADS_SCRIPT, str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    before, after = map(int, run.stdout.split())
    assert after == before


# ------------------------------------------------------------------- durability and unreadable checkpoints
def test_a_checkpoint_is_fsynced_before_its_rename_and_its_directory_after(tmp_path, monkeypatch):
    """A machine crash must never leave a `step_N` whose files are empty or short: the rename reaches the
    disk before the data on ext4 and XFS unless the data was fsynced first."""
    import dsv4rl.train.checkpoint as module

    events = []
    monkeypatch.setattr(module, "fsync_tree", lambda path: events.append(("tree", Path(path).name)))
    monkeypatch.setattr(module, "fsync_dir", lambda path: events.append(("dir", Path(path).name)))
    monkeypatch.setattr(module, "fsync_file", lambda path: events.append(("file", Path(path).name)))
    real_rename = Path.rename

    def rename(self: Path, to: Path) -> Path:
        if self.name.startswith("step_"):  # not DCP's own .metadata.tmp
            events.append(("rename", self.name))
        return real_rename(self, to)

    monkeypatch.setattr(Path, "rename", rename)
    model, opt, counters = make(0)
    save_checkpoint(checkpoint_dir(tmp_path / "checkpoints", 2), model, opt, counters)
    assert events == [
        ("file", "extra_rank00000.pt"),  # each rank its own file
        ("tree", "step_00000002.tmp"),  # rank 0: every file and directory, trainer_state.pt included
        ("rename", "step_00000002.tmp"),
        ("dir", "checkpoints"),  # the rename
        ("dir", tmp_path.name),  # the checkpoints/ directory's own entry
    ]


def _truncate(checkpoint: Path, pattern: str) -> None:
    for path in checkpoint.glob(pattern):
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _two_checkpoints(root: Path):
    """Checkpoints of step 1 and step 2 with different weights; returns a model and the step-1 weights."""
    model, opt, counters = make(0)
    train(model, opt, counters, 1, seed=1)
    save_checkpoint(checkpoint_dir(root, 1), model, opt, counters, extra_state={"cursor": 1})
    at_step_1 = {k: v.clone() for k, v in model.state_dict().items()}
    train(model, opt, counters, 1, seed=2)
    save_checkpoint(checkpoint_dir(root, 2), model, opt, counters, extra_state={"cursor": 2})
    return at_step_1


@pytest.mark.parametrize("broken", ["*.distcp", "trainer_state.pt", "extra_rank00000.pt", ".metadata"])
def test_an_unreadable_newest_checkpoint_is_named_and_the_one_before_is_loaded(tmp_path, caplog, broken):
    at_step_1 = _two_checkpoints(tmp_path)
    _truncate(checkpoint_dir(tmp_path, 2), broken)
    fresh, opt, _ = make(5)
    with caplog.at_level(logging.WARNING):
        path, (counters, extra) = load_newest(tmp_path, lambda d: load_checkpoint(d, fresh, opt))
    assert path == checkpoint_dir(tmp_path, 1) and counters["step"] == 1 and extra == {"cursor": 1}
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, at_step_1[key]), key  # all of step 1, whatever step 2's attempt wrote
    newest = checkpoint_dir(tmp_path, 2)
    file = {"*.distcp": "model/optimizer shards (*.distcp)"}.get(broken, broken)
    assert f"checkpoint {newest} cannot be loaded ({file}: " in caplog.text
    assert "; falling back to step_00000001" in caplog.text
    assert f"resumed from the older checkpoint {checkpoint_dir(tmp_path, 1)} instead" in caplog.text


def test_small_files_are_read_before_the_model_is_touched(tmp_path):
    _two_checkpoints(tmp_path)
    (checkpoint_dir(tmp_path, 2) / "trainer_state.pt").write_bytes(b"\x80\x04garbage")
    fresh, opt, _ = make(5)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(CheckpointUnreadable, match="00002 cannot be loaded: trainer_state.pt: Unpickling"):
        load_checkpoint(checkpoint_dir(tmp_path, 2), fresh, opt)
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())


def test_when_no_checkpoint_loads_every_one_is_named_with_the_way_out(tmp_path):
    _two_checkpoints(tmp_path)
    for step in (1, 2):
        _truncate(checkpoint_dir(tmp_path, step), "*.distcp")
    fresh, opt, _ = make(5)
    with pytest.raises(CheckpointUnreadable) as raised:
        load_newest(tmp_path, lambda d: load_checkpoint(d, fresh, opt))
    message = str(raised.value)
    assert message.startswith(f"none of the 2 checkpoint(s) in {tmp_path} loads (step_00000002: ")
    assert "; step_00000001: " in message and "move them away (or use a new run.dir)" in message
    assert load_newest(tmp_path / "empty", lambda d: None) is None
