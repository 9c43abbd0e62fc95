"""A bucket on the wire: fused pairs, request metadata and the flattened-bucket layout (pure functions)."""

from __future__ import annotations

import pytest
import torch

from dsv4rl.wire.layout import (
    bucket_metadata,
    dtype_name,
    flatten_bucket,
    flattened_offsets,
    pair_key,
    parse_dtype,
    sort_for_flattening,
    unflatten_bucket,
)


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
