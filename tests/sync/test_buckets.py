"""Bucketing, request metadata and the flattened-bucket wire format (pure functions)."""

from __future__ import annotations

import pytest
import torch
from sync_helpers import trainer_model

from dsv4rl.model.naming import state_dict_to_native
from dsv4rl.sync.buckets import (
    bucket_metadata,
    dtype_name,
    flatten_bucket,
    flattened_offsets,
    iter_buckets,
    pair_key,
    parse_dtype,
    sort_for_flattening,
    unflatten_bucket,
)

PAIRS = [
    ("layers.{i}.attn.wq_a.weight", "layers.{i}.attn.wkv.weight"),
    ("layers.{i}.attn.compressor.wkv.weight", "layers.{i}.attn.compressor.wgate.weight"),
    ("layers.{i}.attn.indexer.compressor.wkv.weight", "layers.{i}.attn.indexer.compressor.wgate.weight"),
]


def _t(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(numel, dtype=dtype)


def _bucket_of(buckets: list[list[tuple[str, torch.Tensor]]]) -> dict[str, int]:
    return {name: index for index, bucket in enumerate(buckets) for name, _ in bucket}


@pytest.fixture(scope="module")
def native_stream() -> list[tuple[str, torch.Tensor]]:
    return list(state_dict_to_native(trainer_model(3).state_dict()))


def test_tiny_model_buckets_respect_size_and_keep_pairs(native_stream) -> None:
    limit = 16 * 1024
    buckets = list(iter_buckets(native_stream, limit))
    assert len(buckets) > 10
    sent = [name for bucket in buckets for name, _ in bucket]
    assert sorted(sent) == sorted(name for name, _ in native_stream)  # each tensor exactly once
    where = _bucket_of(buckets)
    checked = 0
    for layer in range(3):
        for a, b in PAIRS:
            a, b = a.format(i=layer), b.format(i=layer)
            if a in where or b in where:
                assert where[a] == where[b], (a, b)
                checked += 1
    assert checked >= 5  # wq_a/wkv in every layer, compressors in the CSA and HCA layers
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= limit or len(bucket) == 1 or all(pair_key(n) for n, _ in bucket)


def test_oversized_tensor_travels_alone_and_order_is_kept() -> None:
    stream = [("a", _t(10)), ("big", _t(1000)), ("b", _t(10)), ("c", _t(10)), ("d", _t(30))]
    buckets = [[n for n, _ in b] for b in iter_buckets(stream, bucket_bytes=100)]
    assert buckets == [["a"], ["big"], ["b", "c"], ["d"]]
    assert [[n for n, _ in b] for b in iter_buckets(stream, bucket_bytes=10**6)] == [
        ["a", "big", "b", "c", "d"]
    ]
    with pytest.raises(ValueError, match="positive"):
        list(iter_buckets(stream, 0))


def test_pairs_are_held_until_their_partner_arrives() -> None:
    stream = [
        ("layers.0.attn.wq_a.weight", _t(20)),
        ("layers.0.attn.q_norm.weight", _t(20)),
        ("layers.0.attn.wq_b.weight", _t(20)),
        ("layers.0.attn.wkv.weight", _t(20)),
        ("layers.0.attn.wo_a.weight", _t(20)),  # unquantised: no scale comes; released at the next layer
        ("layers.0.attn.wo_b.weight", _t(20)),
        ("layers.1.attn_norm.weight", _t(20)),
    ]
    buckets = [[n for n, _ in b] for b in iter_buckets(stream, bucket_bytes=100)]
    where = {name: i for i, names in enumerate(buckets) for name in names}
    assert where["layers.0.attn.wq_a.weight"] == where["layers.0.attn.wkv.weight"]
    assert where["layers.0.attn.wo_a.weight"] >= where["layers.0.attn.wo_b.weight"]
    assert sorted(where) == sorted(n for n, _ in stream)
    # a quantised wo_a: weight and scale together, and the fp8 wq_a/wkv weights and scales as pairs
    fp8 = [
        ("layers.0.attn.wo_a.weight", _t(64, torch.float8_e4m3fn)),
        ("layers.0.attn.wq_a.weight", _t(64, torch.float8_e4m3fn)),
        ("layers.0.attn.wq_a.scale", _t(1, torch.float8_e8m0fnu)),
        ("layers.0.attn.wkv.weight", _t(64, torch.float8_e4m3fn)),
        ("layers.0.attn.wo_a.scale", _t(1, torch.float8_e8m0fnu)),
        ("layers.0.attn.wkv.scale", _t(1, torch.float8_e8m0fnu)),
    ]
    where = _bucket_of(list(iter_buckets(fp8, bucket_bytes=64)))
    assert where["layers.0.attn.wo_a.weight"] == where["layers.0.attn.wo_a.scale"]
    assert where["layers.0.attn.wq_a.scale"] == where["layers.0.attn.wkv.scale"]
    assert where["layers.0.attn.wq_a.weight"] == where["layers.0.attn.wkv.weight"]


def test_pair_key_covers_native_sglang_and_hf_names() -> None:
    assert pair_key("layers.3.attn.wq_a.scale") == ("layers.3.attn.wqkv_a", "wq_a", "scale")
    assert pair_key("model.layers.3.self_attn.wkv.weight_scale_inv") == (
        "model.layers.3.self_attn.wqkv_a",
        "wkv",
        "scale",
    )
    assert pair_key("model.layers.3.self_attn.kv_proj.weight")[0] == "model.layers.3.self_attn.wqkv_a"
    assert pair_key("model.layers.3.self_attn.compressor.indexer.gate_proj.weight")[1] == "wgate"
    assert pair_key("mtp.0.attn.compressor.wgate.weight")[0] == "mtp.0.attn.compressor.wkv_gate"
    for single in ("layers.3.attn.wq_b.weight", "layers.3.attn.indexer.wq_b.weight", "embed.weight"):
        assert pair_key(single) is None


def test_metadata_uses_bare_dtype_names() -> None:
    bucket = [("x", torch.zeros(2, 3, dtype=torch.bfloat16)), ("t", torch.zeros(4, 2, dtype=torch.int64))]
    assert bucket_metadata(bucket) == {
        "names": ["x", "t"],
        "dtypes": ["bfloat16", "int64"],
        "shapes": [[2, 3], [4, 2]],
    }
    for dtype in (
        torch.float32,
        torch.bfloat16,
        torch.float8_e4m3fn,
        torch.float8_e8m0fnu,
        torch.int8,
        torch.uint8,
    ):
        assert parse_dtype(dtype_name(dtype)) is dtype
    for bad in ("torch.bfloat16", "bf16", "nn", "", "float"[:0], "Tensor"):
        with pytest.raises(ValueError, match="dtype"):
            parse_dtype(bad)


def test_flatten_round_trip_in_descending_itemsize_order() -> None:
    gen = torch.Generator().manual_seed(0)
    bucket = [
        ("u8", torch.randint(0, 255, (3,), dtype=torch.uint8, generator=gen)),
        ("bf16", torch.randn(5, generator=gen).to(torch.bfloat16)),
        ("i64", torch.randint(-(2**40), 2**40, (2, 2), dtype=torch.int64, generator=gen)),
        ("f32", torch.randn(3, 1, generator=gen)),
        ("fp8", torch.randn(7, generator=gen).to(torch.float8_e4m3fn)),
        ("f32b", torch.randn(2, 3, generator=gen)[:, 1:]),  # not contiguous
    ]
    ordered = sort_for_flattening(bucket)
    assert [n for n, _ in ordered] == ["i64", "f32", "f32b", "bf16", "u8", "fp8"]
    meta = bucket_metadata(ordered)
    flat = flatten_bucket(ordered)
    assert flat.dtype == torch.uint8 and flat.numel() == sum(t.numel() * t.element_size() for _, t in bucket)
    dtypes = [parse_dtype(d) for d in meta["dtypes"]]
    for (name, original), restored in zip(
        ordered, unflatten_bucket(flat, dtypes, meta["shapes"]), strict=True
    ):
        assert restored.dtype == original.dtype and restored.shape == original.shape, name
        assert restored.view(torch.uint8).equal(original.contiguous().view(torch.uint8)), name
    with pytest.raises(ValueError, match="Unaligned"):
        flatten_bucket(bucket)  # the unsorted order puts bf16 at an odd offset
    with pytest.raises(ValueError, match="Unaligned"):
        flattened_offsets([torch.uint8, torch.float32], [[1], [1]])
    with pytest.raises(ValueError, match="expected"):
        unflatten_bucket(flat[:-1], dtypes, meta["shapes"])
