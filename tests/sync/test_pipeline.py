"""The sync pipeline: native names -> wire format -> buckets; quantized pairs and fused partners whole."""

from __future__ import annotations

import pytest
import torch
from sync_helpers import trainer_model

from dsv4rl.config.choices import QuantMode
from dsv4rl.model.wire_format import WireFormat
from dsv4rl.sync.buckets import iter_buckets
from dsv4rl.sync.pipeline import encode, native_names, wire_buckets


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return trainer_model(7)


def _where(buckets) -> dict[str, int]:
    return {name: index for index, bucket in enumerate(buckets) for name, _ in bucket}


@pytest.mark.parametrize("mode", [QuantMode.fp8_rollout, QuantMode.fp8_mxfp4])
@pytest.mark.parametrize("bucket_bytes", [1, 2048, 1 << 30])
def test_every_weight_travels_with_its_scale_and_fused_partners(model, mode, bucket_bytes) -> None:
    buckets = list(wire_buckets(model.state_dict().items(), WireFormat(mode), bucket_bytes))
    where = _where(buckets)
    names = [name for bucket in buckets for name, _ in bucket]
    assert len(names) == len(set(names))
    scales = [n for n in names if n.endswith(".scale")]
    assert len(scales) == 97  # 8 linears x 3 layers + 1 indexer, 3 x 8 experts x 3 projections
    for scale in scales:
        assert where[scale] == where[scale.removesuffix(".scale") + ".weight"], scale
    for layer in range(3):  # SGLang fuses these at load time
        group = [f"layers.{layer}.attn.{m}.{s}" for m in ("wq_a", "wkv") for s in ("weight", "scale")]
        assert len({where[n] for n in group}) == 1, group
    for layer in (1, 2):
        pair = [f"layers.{layer}.attn.compressor.{m}.weight" for m in ("wkv", "wgate")]
        assert where[pair[0]] == where[pair[1]]
    if bucket_bytes == 1:  # nothing shares a bucket unless it must
        assert max(len(b) for b in buckets) == 4


def test_the_pipeline_is_lazy_and_names_are_native(model) -> None:
    stream = native_names(model.state_dict().items())
    first = next(stream)
    assert first[0] == "embed.weight"
    units = list(encode(native_names(model.state_dict().items()), None))
    assert all(len(unit) == 1 for unit in units)
    assert any(unit[0][0] == "layers.1.ffn.experts.7.w2.weight" for unit in units)


def test_sharded_tensors_are_refused(model) -> None:
    from torch.distributed.tensor import DTensor

    class Fake(DTensor):  # isinstance is all native_names looks at
        def __new__(cls):
            return torch.Tensor._make_subclass(cls, torch.zeros(1))

    with pytest.raises(ValueError, match="sharded DTensor"):
        list(native_names([("model.norm.weight", Fake())]))


def test_units_are_never_split_across_buckets() -> None:
    units = [[("a.weight", torch.zeros(10)), ("a.scale", torch.zeros(1))], ("b.weight", torch.zeros(10))]
    buckets = list(iter_buckets(units, 8))
    assert [[n for n, _ in b] for b in buckets] == [["a.weight", "a.scale"], ["b.weight"]]
