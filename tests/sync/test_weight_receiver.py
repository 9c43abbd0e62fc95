"""WeightReceiver against a real rank-0 peer process: every bad request fails BEFORE any broadcast.

The receiver holds the tiny model as the release stores it (fp8_mxfp4: FP8 linears with E8M0 scales,
int8-packed MXFP4 experts, BF16 and FP32 tensors, int64 tid2eid). Its group timeout is short, so an
implementation that joined a broadcast for a bad request would raise a timeout error (not ValueError) or
desynchronise the good transfers that follow.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
from sync_helpers import ENGINE_SEED, TRAINER_SEED, run_python, trainer_model, wire_tensors

from dsv4rl.engine.weight_receiver import WeightReceiver
from dsv4rl.engine.weight_store import DeepseekWeights
from dsv4rl.model.naming import native_slot, slot_view
from dsv4rl.model.native_checkpoint import dequantized_native_state
from dsv4rl.model.tokenizer import build_char_tokenizer
from dsv4rl.wire.layout import bucket_metadata, sort_for_flattening
from free_ports import free_port

VOCAB = len(build_char_tokenizer())  # the tiny model's vocabulary: its embedding rows, tid2eid's rows

GROUP = "receiver_test_group"
QUANT = "fp8_mxfp4"
PLAIN = [
    "layers.0.ffn.gate.tid2eid",
    "layers.1.ffn.gate.bias",
    "layers.1.ffn.experts.3.w1.weight",
    "layers.1.ffn.experts.3.w1.scale",
    "layers.1.ffn.experts.5.w2.weight",
    "layers.1.ffn.experts.5.w2.scale",
    "layers.0.attn.wq_a.weight",
    "layers.0.attn.wq_a.scale",
    "layers.0.attn.wkv.weight",
    "layers.0.attn.wkv.scale",
    "embed.weight",
]
FLAT = [
    "layers.2.ffn.gate.bias",
    "layers.2.attn.compressor.wkv.weight",
    "layers.2.attn.compressor.wgate.weight",
    "layers.2.attn.wo_b.weight",
    "layers.2.attn.wo_b.scale",
    "layers.0.hc_attn_scale",
    "head.weight",
]


@pytest.fixture(scope="module")
def source() -> dict[str, torch.Tensor]:
    """The trainer's weights in the engine's format."""
    return {name: t.clone() for name, t in wire_tensors(trainer_model(TRAINER_SEED), QUANT).items()}


def engine_weights() -> DeepseekWeights:
    model = trainer_model(ENGINE_SEED)
    stored = wire_tensors(model, QUANT)
    from dsv4rl.model.native_checkpoint import load_native_state

    load_native_state(model, dequantized_native_state(stored, (128, 128)))
    return DeepseekWeights(model, stored, (128, 128), served=QUANT)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, source) -> Iterator[tuple[WeightReceiver, object, dict]]:
    plain = [(n, source[n]) for n in PLAIN]
    flat = sort_for_flattening([(n, source[n]) for n in FLAT])
    path = tmp_path_factory.mktemp("receiver") / "tensors.pt"
    torch.save({"plain": plain, "flat": flat}, path)
    port = free_port()
    peer = run_python("_trainer_peer.py", str(port), GROUP, str(path))
    receiver = WeightReceiver(engine_weights(), timeout_s=5)
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


BAD_REQUESTS = [
    ({"group_name": "nope"}, "no weight-update group named 'nope'"),
    ({"dtypes": ["bfloat16", "bfloat16"]}, "same length"),
    ({"names": [], "dtypes": [], "shapes": []}, "names no tensors"),
    ({"dtypes": ["torch.bfloat16"]}, "bare torch name"),
    ({"dtypes": ["Tensor"]}, "no dtype of that name"),
    ({"names": ["layers.0.attn.nope.weight"]}, "holds no tensor of that name"),
    ({"names": ["layers.7.attn_norm.weight"]}, "holds no tensor of that name"),
    ({"names": ["model.norm.weight"]}, "holds no tensor of that name"),  # transformers names are not held
    ({"shapes": [[64, 1]]}, r"holds bfloat16 \[64\] .* sends bfloat16 \[64, 1\]"),
    ({"dtypes": ["float32"]}, r"norm.weight: the engine holds bfloat16 \[64\] \(it serves fp8_mxfp4\)"),
    (
        {"names": ["layers.0.ffn.gate.tid2eid"], "dtypes": ["int32"], "shapes": [[VOCAB, 2]]},
        rf"holds int64 \[{VOCAB}, 2\] .* sends int32",
    ),
    (  # BF16 into an FP8 weight: SGLang would refuse partway ("Downcasting not allowed") or cast silently
        {
            "names": ["layers.1.attn.wq_b.weight", "layers.1.attn.wq_b.scale"],
            "dtypes": ["bfloat16", "float8_e8m0fnu"],
            "shapes": [[128, 32], [1, 1]],
        },
        r"wq_b.weight: the engine holds float8_e4m3fn \[128, 32\] .* sends bfloat16 \[128, 32\]",
    ),
    (  # an FP8 weight without its scale would be dequantized with the old scale
        {"names": ["layers.1.attn.wq_b.weight"], "dtypes": ["float8_e4m3fn"], "shapes": [[128, 32]]},
        "wq_b.weight arrived without layers.1.attn.wq_b.scale",
    ),
    (
        {"names": ["layers.1.ffn.experts.0.w2.scale"], "dtypes": ["float8_e8m0fnu"], "shapes": [[64, 1]]},
        "w2.scale arrived without layers.1.ffn.experts.0.w2.weight",
    ),
    ({"names": ["norm.weight", "norm.weight"], "dtypes": ["bfloat16"] * 2, "shapes": [[64]] * 2}, "repeat"),
    (
        {
            "names": ["layers.0.attn.wq_a.weight", "layers.0.attn.wq_a.scale"],
            "dtypes": ["float8_e4m3fn", "float8_e8m0fnu"],
            "shapes": [[32, 64], [1, 1]],
        },
        "half of a fused pair",
    ),
    (
        {
            "names": ["layers.0.hc_attn_scale", "layers.0.attn_norm.weight"],
            "dtypes": ["float32", "bfloat16"],
            "shapes": [[3], [64]],
            "load_format": "flattened_bucket",
        },
        None,  # allowed: descending itemsize
    ),
    (  # the 1-byte scale leaves the float32 tensor at an odd offset
        {
            "names": ["layers.1.attn.wq_b.weight", "layers.1.attn.wq_b.scale", "layers.0.hc_attn_scale"],
            "dtypes": ["float8_e4m3fn", "float8_e8m0fnu", "float32"],
            "shapes": [[128, 32], [1, 1], [3]],
            "load_format": "flattened_bucket",
        },
        "Unaligned",
    ),
]


@pytest.mark.parametrize(("override", "message"), [r for r in BAD_REQUESTS if r[1] is not None])
def test_bad_request_is_refused_before_any_broadcast(setup, override, message) -> None:
    receiver, _, _ = setup
    before = {k: v.clone() for k, v in receiver.held.state().items()}
    model_before = {k: v.clone() for k, v in receiver.held.model.state_dict().items()}
    request = {"names": ["norm.weight"], "dtypes": ["bfloat16"], "shapes": [[64]], "group_name": GROUP}
    request.update(override)
    start = time.monotonic()
    with pytest.raises(ValueError, match=message):
        receiver.receive(**request)
    assert time.monotonic() - start < 2.0
    assert all(receiver.held.state()[k].equal(v) for k, v in before.items())
    after = receiver.held.model.state_dict()
    assert all(after[k].equal(v) for k, v in model_before.items())


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
    """Runs after the refusals above: had any of them joined a broadcast, these would desynchronise.

    FP8 and E8M0 tensors cross gloo as bytes; the engine then holds them bit for bit and its forward
    model holds their dequantized values."""
    receiver, peer, buckets = setup
    held = receiver.held
    for name, _ in buckets["plain"] + buckets["flat"]:  # (one-tile scales of two seeds may coincide)
        if not name.endswith(".scale"):
            assert not held.state()[name].view(torch.uint8).equal(source[name].view(torch.uint8)), name
    _transfer(receiver, peer, "send plain", buckets["plain"])
    _transfer(receiver, peer, "sendflat flat", buckets["flat"], load_format="flattened_bucket")
    expected = dequantized_native_state(source, (128, 128))
    state = held.model.state_dict()
    for name, _ in buckets["plain"] + buckets["flat"]:
        got = held.state()[name]
        assert got.dtype == source[name].dtype and got.view(torch.uint8).equal(source[name].view(torch.uint8))
        if not name.endswith(".scale"):
            computed = slot_view(state, native_slot(name))
            assert computed.equal(expected[name].to(computed.dtype)), name
