"""WeightReceiver against a real rank-0 peer process: every bad request fails BEFORE any broadcast.

The receiver's group timeout is short, so an implementation that joined a broadcast for a bad request
would raise a timeout error (not ValueError) or desynchronise the good transfers that follow.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
from sync_helpers import ENGINE_SEED, TRAINER_SEED, free_port, run_python, trainer_model, vocab_size

from dsv4rl.engine.weight_receiver import WeightReceiver
from dsv4rl.model.naming import native_slot, slot_view, state_dict_to_native
from dsv4rl.sync.buckets import bucket_metadata, sort_for_flattening

GROUP = "receiver_test_group"
PLAIN = [
    "layers.0.ffn.gate.tid2eid",
    "layers.1.ffn.gate.bias",
    "layers.1.ffn.experts.3.w1.weight",
    "layers.1.ffn.experts.3.w3.weight",
    "layers.1.ffn.experts.5.w2.weight",
    "layers.0.attn.wq_a.weight",
    "layers.0.attn.wkv.weight",
    "embed.weight",
]
FLAT = [
    "layers.2.ffn.gate.bias",
    "layers.2.attn.compressor.wkv.weight",
    "layers.2.attn.compressor.wgate.weight",
    "layers.2.ffn.gate.weight",
    "layers.0.hc_attn_scale",
    "head.weight",
]


@pytest.fixture(scope="module")
def source() -> dict[str, torch.Tensor]:
    return {
        name: t.detach().clone() for name, t in state_dict_to_native(trainer_model(TRAINER_SEED).state_dict())
    }


@pytest.fixture(scope="module")
def setup(tmp_path_factory, source) -> Iterator[tuple[WeightReceiver, object]]:
    plain = [(n, source[n]) for n in PLAIN]
    plain[0] = (plain[0][0], plain[0][1].to(torch.int32))  # Megatron/SGLang keep tid2eid as int32
    plain.append(("model.norm.weight", source["norm.weight"]))  # a transformers name is accepted too
    flat = sort_for_flattening([(n, source[n]) for n in FLAT])
    path = tmp_path_factory.mktemp("receiver") / "tensors.pt"
    torch.save({"plain": plain, "flat": flat}, path)
    port = free_port()
    peer = run_python("_trainer_peer.py", str(port), GROUP, str(path))
    receiver = WeightReceiver(trainer_model(ENGINE_SEED), timeout_s=5)
    try:
        receiver.init_group("127.0.0.1", port, rank_offset=1, world_size=2, group_name=GROUP, backend="gloo")
        assert peer.stdout.readline().strip() == "joined"
        yield receiver, peer, {"plain": plain, "flat": flat}
    finally:
        if receiver.has_group(GROUP):
            receiver.destroy_group(GROUP)
        try:
            peer.communicate("exit\n", timeout=20)
        except Exception:
            peer.kill()
            peer.communicate(timeout=10)


def _slot(receiver: WeightReceiver, name: str) -> torch.Tensor:
    state = receiver.model.state_dict()
    return state[name] if name in state else slot_view(state, native_slot(name))


BAD_REQUESTS = [
    ({"group_name": "nope"}, "no weight-update group named 'nope'"),
    ({"dtypes": ["float32", "float32"]}, "same length"),
    ({"names": [], "dtypes": [], "shapes": []}, "names no tensors"),
    ({"dtypes": ["torch.float32"]}, "bare torch name"),
    ({"dtypes": ["Tensor"]}, "no dtype of that name"),
    ({"names": ["layers.0.attn.nope.weight"]}, "unknown tensor name"),
    ({"names": ["layers.7.attn_norm.weight"]}, "unknown tensor name"),
    ({"shapes": [[64, 1]]}, r"shape \[64, 1\] does not match the model's \[64\]"),
    (
        {"names": ["layers.0.ffn.gate.tid2eid"], "dtypes": ["float32"], "shapes": [[vocab_size(), 2]]},
        "never through a float",
    ),
    ({"dtypes": ["int64"]}, "integer vs float"),
    ({"names": ["norm.weight", "norm.weight"], "dtypes": ["float32"] * 2, "shapes": [[64]] * 2}, "repeat"),
    ({"names": ["layers.0.attn.wq_a.weight"], "shapes": [[32, 64]]}, "half of a fused pair"),
    (
        {
            "names": ["layers.0.hc_attn_scale", "layers.0.attn_norm.weight"],
            "dtypes": ["float8_e4m3fn", "float32"],
            "shapes": [[3], [64]],
            "load_format": "flattened_bucket",
        },
        "Unaligned",
    ),
]


@pytest.mark.parametrize(("override", "message"), BAD_REQUESTS)
def test_bad_request_is_refused_before_any_broadcast(setup, override, message) -> None:
    receiver, _, _ = setup
    before = {k: v.clone() for k, v in receiver.model.state_dict().items()}
    request = {"names": ["norm.weight"], "dtypes": ["float32"], "shapes": [[64]], "group_name": GROUP}
    request.update(override)
    start = time.monotonic()
    with pytest.raises(ValueError, match=message):
        receiver.receive(**request)
    assert time.monotonic() - start < 2.0
    after = receiver.model.state_dict()
    assert all(after[k].equal(v) for k, v in before.items())


def test_bad_group_requests_are_refused_without_rendezvous(setup) -> None:
    receiver, _, _ = setup
    args = {"master_address": "127.0.0.1", "master_port": free_port(), "world_size": 2, "backend": "gloo"}
    for override, message in [
        ({"group_name": GROUP, "rank_offset": 1}, "already exists"),
        ({"group_name": "g2", "rank_offset": 0}, "rank 0 is the trainer"),
        ({"group_name": "g2", "rank_offset": 1, "world_size": 1}, "at least 2"),
        ({"group_name": "g2", "rank_offset": 1, "backend": "mpi"}, "choose from"),
        ({"group_name": "g2", "rank_offset": 1, "master_port": 0}, "master_port"),
    ]:
        start = time.monotonic()
        with pytest.raises(ValueError, match=message):
            receiver.init_group(**{**args, **override})
        assert time.monotonic() - start < 2.0
    with pytest.raises(ValueError, match="does not exist"):
        receiver.destroy_group("g2")
    assert receiver.has_group(GROUP) and not receiver.has_group("g2")


def _transfer(receiver, peer, command: str, bucket, load_format=None) -> None:
    meta = bucket_metadata(bucket)
    peer.stdin.write(command + "\n")
    peer.stdin.flush()
    receiver.receive(meta["names"], meta["dtypes"], meta["shapes"], GROUP, load_format)
    assert peer.stdout.readline().split() == ["done", command.split()[0]]


def test_receive_per_tensor_then_flattened(setup, source) -> None:
    """Runs after the refusals above: had any of them joined a broadcast, these would desynchronise."""
    receiver, peer, buckets = setup
    for name, _ in buckets["plain"] + buckets["flat"]:
        assert not _slot(receiver, name).equal(source.get(name, source["norm.weight"]))
    _transfer(receiver, peer, "send plain", buckets["plain"])
    _transfer(receiver, peer, "sendflat flat", buckets["flat"], load_format="flattened_bucket")
    for name, _ in buckets["plain"] + buckets["flat"]:
        expected = source["norm.weight"] if name == "model.norm.weight" else source[name]
        got = _slot(receiver, name)
        assert got.dtype == expected.dtype and got.equal(expected), name
    assert _slot(receiver, "layers.0.ffn.gate.tid2eid").dtype == torch.int64
