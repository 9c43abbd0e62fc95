"""Bucketing a weight stream into update requests (pure functions; the layout: tests/wire)."""

from __future__ import annotations

import pytest
import torch
from sync_helpers import trainer_model

from dsv4rl.model.naming import state_dict_to_native
from dsv4rl.sync.buckets import iter_buckets
from dsv4rl.wire.layout import pair_key

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
