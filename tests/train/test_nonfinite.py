"""The non-finite guard's parts that need no trainer ranks: the weight sync refusing a NaN (naming it),
the loop refusing to push non-finite weights, checkpoint pruning keeping the newest finite checkpoint, the
recipe key and the test hook. The skip itself runs on both backends under torchrun
(tests/train/fsdp, tests/train/megatron) and end to end (tests/e2e/test_nonfinite_cpu.py)."""

from __future__ import annotations

import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dsv4rl.checks.validate import validate
from dsv4rl.config.compose import ConfigError, compose
from dsv4rl.config.schema import Config, SyncConfig
from dsv4rl.faults.nonfinite import (
    NONFINITE_ENV,
    InjectTarget,
    NonFiniteError,
    first_nonfinite,
    injected,
    parse_injections,
)
from dsv4rl.sync.errors import NonFiniteWeight, WeightSyncError
from dsv4rl.sync.weight_sync import WeightSync
from dsv4rl.train.checkpoint_dirs import FINITE, TRAINER_STATE, checkpoint_dir, prune_checkpoints


class Engine:
    """An engine that answers every session request (what WeightSync calls around the buckets)."""

    def __init__(self, calls: list) -> None:
        self.calls = calls

    async def begin_weight_update(self) -> dict:
        self.calls.append("begin")
        return {"success": True}

    async def end_weight_update(self) -> dict:
        self.calls.append("end")
        return {"success": True}


class Recording:
    """A transport that records the names of every bucket it was given."""

    broken = None

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def connect(self) -> None: ...

    def send(self, bucket, weight_version, what, *, flush_cache=False) -> int:  # noqa: ANN001
        self.calls.append([name for name, _ in bucket])
        return sum(t.numel() * t.element_size() for _, t in bucket)

    def close(self) -> None: ...


def recording_sync(calls: list) -> WeightSync:
    sync = WeightSync([Engine(calls)], SyncConfig(bucket_bytes=64, timeout_s=10), "gloo", "127.0.0.1", 1,
                      pause=False, load_format="per_tensor")  # fmt: skip
    sync._build_transport = lambda: Recording(calls)
    sync.connect()
    return sync


def weights(poisoned: str | None = None, value: float = float("nan")) -> list[tuple[str, torch.Tensor]]:
    """Five 64-byte tensors (a bucket each at bucket_bytes=64), one of them holding `value`."""
    out = [(f"extra.w{i}", torch.full((16,), float(i))) for i in range(5)]
    return [(name, tensor.index_fill(0, torch.tensor([3]), value) if name == poisoned else tensor)
            for name, tensor in out]  # fmt: skip


def test_a_nonfinite_weight_is_refused_by_the_push_naming_it() -> None:
    calls: list = []
    sync = recording_sync(calls)
    try:
        with pytest.raises(NonFiniteWeight) as refused:
            sync.push(weights("extra.w3", float("inf")), "7")
        error = refused.value
        assert isinstance(error, NonFiniteError) and isinstance(error, WeightSyncError)
        assert (error.step, error.phase) == (7, "sync")
        assert "extra.w3" in error.tensor and "step 7, phase sync" in str(error)
        copied = pickle.loads(pickle.dumps(error))  # crosses processes whole
        assert type(copied) is NonFiniteWeight and str(copied) == str(error) and copied.step == 7
        sent = [item for item in calls if isinstance(item, list)]
        # a bucket before it went; the pipeline had pulled w3 (two buckets ahead) before w1's was sent
        assert sent == [["extra.w0"]]
        assert calls[-1] == "end"  # the session was closed: a later push can open one
        calls.clear()
        sync.push(weights(), "8")  # finite weights pass
        assert [item for item in calls if isinstance(item, list)] == [[f"extra.w{i}"] for i in range(5)]
    finally:
        sync.close()


def test_a_nonfinite_first_weight_sends_nothing() -> None:
    calls: list = []
    sync = recording_sync(calls)
    try:
        with pytest.raises(NonFiniteWeight, match="extra.w0"):
            sync.push(weights("extra.w0"), "1")
        assert not [item for item in calls if isinstance(item, list)]
    finally:
        sync.close()


def test_the_loop_never_pushes_nonfinite_weights(monkeypatch) -> None:
    """RLLoop.push_weights checks the trainer's weights (collectively) before anything is gathered."""
    import dsv4rl.train.loop as loop_module
    from dsv4rl.train.loop import RLLoop

    monkeypatch.setattr(loop_module.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(loop_module.dist, "get_world_size", lambda: 1)
    pushed = []

    class Backend:
        device = torch.device("cpu")

        def local_weights(self):
            yield "model.embed_tokens.weight", torch.ones(4)
            yield "model.norm.weight", torch.tensor([1.0, float("nan"), 1.0])

        def named_weights_for_sync(self, by_stage=False):
            pushed.append("gathered")
            yield from self.local_weights()

    class Sync:
        by_stage = False

        def push(self, named, version, record_checksums):
            pushed.append(version)

    driver = SimpleNamespace(colocated=None, roster=None)
    loop = RLLoop(Config(), Backend(), Path("unused"), driver=driver, weight_sync=Sync())
    with pytest.raises(NonFiniteError) as stopped:
        loop.push_weights(version=5)
    assert (stopped.value.step, stopped.value.phase) == (5, "sync")
    assert "weight model.norm.weight (NaN in 1 of 3 elements)" in str(stopped.value)
    assert "nothing was pushed to the engines" in str(stopped.value)
    assert pushed == []


def mark(root: Path, step: int, finite: bool | None, unreadable: bool = False) -> Path:
    path = checkpoint_dir(root, step)
    path.mkdir(parents=True)
    state = {"step": step, "updates": step} if finite is None else {"step": step, FINITE: finite}
    if unreadable:
        (path / TRAINER_STATE).write_bytes(b"truncated")
    else:
        torch.save(state, path / TRAINER_STATE)
    return path


def test_pruning_keeps_the_newest_finite_checkpoint_nonfinite(tmp_path: Path) -> None:
    mark(tmp_path, 1, True)
    mark(tmp_path, 2, True)
    mark(tmp_path, 3, None)  # written before the mark existed: not known to be finite
    mark(tmp_path, 4, False)
    mark(tmp_path, 5, True, unreadable=True)  # truncated since: not known to be finite
    removed = prune_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in removed) == ["step_00000001", "step_00000003"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002", "step_00000004", "step_00000005"]
    # once a newer finite one is among the newest `keep`, the old one goes as usual
    mark(tmp_path, 6, True)
    prune_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000005", "step_00000006"]


def test_max_nonfinite_steps_is_a_recipe_key_nonfinite() -> None:
    cfg = compose("tiny_arith", ["train.max_nonfinite_steps=0"])
    assert cfg.train.max_nonfinite_steps == 0
    cfg.train.max_nonfinite_steps = -1
    with pytest.raises(ConfigError, match="train.max_nonfinite_steps must be >= 0"):
        validate(cfg, check_paths=False)


def test_the_nonfinite_test_hook(monkeypatch) -> None:
    assert parse_injections("advantages:2, weights") == [
        (InjectTarget.advantages, 2),
        (InjectTarget.weights, None),
    ]
    with pytest.raises(ValueError, match="the target must be one of advantages, weights"):
        parse_injections("loss:2")
    with pytest.raises(ValueError, match="the step must be an integer"):
        parse_injections("weights:x")
    monkeypatch.setenv(NONFINITE_ENV, "advantages:2,weights")
    assert injected(InjectTarget.advantages, 2) and not injected(InjectTarget.advantages, 3)
    assert injected(InjectTarget.weights, 9)
    monkeypatch.delenv(NONFINITE_ENV)
    assert not injected(InjectTarget.weights, 9)


def test_first_nonfinite_names_and_counts() -> None:
    big = torch.zeros((1 << 24) + 5)
    big[-1] = float("-inf")  # past the first chunk
    named = [
        ("a", torch.ones(3)),
        ("ids", torch.arange(4)),
        ("big", big),
        ("c", torch.tensor([float("nan")])),
    ]
    assert first_nonfinite(named) == ("big", "Inf in 1 of 16777221 elements")
    assert first_nonfinite(named[:2]) is None
    # what a push may carry already quantized: FP8 (no isfinite on the CPU for e4m3), E8M0 scales, FP4 pairs
    fp8 = torch.tensor([1.0, float("nan"), 2.0]).to(torch.float8_e4m3fn)
    scales = torch.tensor([1.0, float("nan")]).to(torch.float8_e8m0fnu)
    fp4 = torch.full((4,), 0xFF, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    quantized = [("fp4", fp4), ("fp8.ok", fp8[:1]), ("fp8", fp8), ("scale", scales)]
    assert first_nonfinite(quantized) == ("fp8", "NaN in 1 of 3 elements")
    assert first_nonfinite(quantized[3:]) == ("scale", "NaN in 1 of 2 elements")


def test_megatrons_distributed_optimizer_is_split_as_its_own_step_nonfinite(monkeypatch) -> None:
    """MegatronDistributedAdam (GPU only; launch/gpu_check.sh runs it) calls the parts of megatron-core's
    `ChainedOptimizer.step` in its order: `grad_norm` = prepare_grads + get_grad_norm (a found Inf reads
    as NaN), `step` = clip each non-stub part by that norm + step_with_ready_grads; a skip is neither."""
    import megatron.core.optimizer.clip_grads as clip_grads

    from dsv4rl.train.megatron.optimizer import MegatronDistributedAdam

    calls: list = []
    monkeypatch.setattr(
        clip_grads,
        "clip_grad_by_total_norm_fp32",
        lambda params, max_norm, total_norm, use_decoupled_grad: calls.append(
            ("clip", params, max_norm, total_norm, use_decoupled_grad)
        ),
    )
    config = SimpleNamespace(clip_grad=1.0, use_precision_aware_optimizer_no_fp8_or_ds_fp8=False)

    class Part:
        def __init__(self, name: str, stub: bool = False) -> None:
            self.name, self.is_stub_optimizer, self.config = name, stub, config

        def get_parameters(self) -> list:
            return [self.name]

    class Chained:
        chained_optimizers = [Part("dense"), Part("stub", stub=True), Part("expert")]
        found_inf = False

        def prepare_grads(self) -> bool:
            calls.append("prepare_grads")
            return self.found_inf

        def get_grad_norm(self) -> float:
            calls.append("get_grad_norm")
            return 2.5

        def step_with_ready_grads(self) -> bool:
            calls.append("step_with_ready_grads")
            return True

    optimizer = object.__new__(MegatronDistributedAdam)
    optimizer.optimizer = Chained()
    assert optimizer.grad_norm() == 2.5
    optimizer.step()
    assert calls == [
        "prepare_grads",
        "get_grad_norm",
        ("clip", ["dense"], 1.0, 2.5, False),
        ("clip", ["expert"], 1.0, 2.5, False),
        "step_with_ready_grads",
    ]
    calls.clear()
    optimizer.optimizer.found_inf = True  # a loss scaler's Inf (fp16): the step is skipped by the loop
    assert optimizer.grad_norm() != optimizer.grad_norm()
    assert calls == ["prepare_grads", "get_grad_norm"] * 2
