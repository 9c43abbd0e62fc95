"""Split a weight stream into update requests ("buckets"): the trainer's side of the bucket layout.

`iter_buckets` bounds each `/update_weights_from_distributed` request to `bucket_bytes` (the server
allocates every tensor of a request at once), while keeping together what must share a request
(`dsv4rl.wire.layout.pair_key`: a quantized weight and its `.scale`, and the tensors SGLang fuses at
load time). What a bucket looks like on the wire is `dsv4rl.wire.layout`'s.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

from dsv4rl.wire.layout import NamedTensor, pair_key

__all__ = ["iter_buckets"]

_LAYER = re.compile(r"^((?:model\.)?(?:layers|mtp)\.\d+\.)")


def _layer_of(name: str) -> str:
    match = _LAYER.match(name)
    return match.group(1) if match else ""


class _Bundle:
    """Partners collected so far; complete when every member kind has the same non-empty suffix set."""

    def __init__(self, key: str, layer: str, wo_a: bool) -> None:
        self.key, self.layer, self.wo_a = key, layer, wo_a
        self.items: list[NamedTensor] = []
        self.members: dict[str, set[str]] = {}

    def add(self, item: NamedTensor, kind: str, suffix: str) -> None:
        self.items.append(item)
        self.members.setdefault(kind, set()).add(suffix)

    def complete(self) -> bool:
        if self.wo_a:
            return {"weight", "scale"} <= self.members.keys()
        if len(self.members) < 2:
            return False
        suffixes = list(self.members.values())
        return all(s == suffixes[0] for s in suffixes)


def _units(stream: Iterable[NamedTensor | list[NamedTensor]]) -> Iterator[list[NamedTensor]]:
    """Group the stream into units that must share a bucket, keeping the stream order otherwise.

    Items are single (name, tensor) pairs or lists that already form a unit (a weight and its scale).
    An incomplete bundle (e.g. an unquantised wo_a without scale) is released when the stream moves on
    to another layer, so at most about one layer's tensors are held back.
    """
    pending: dict[str, _Bundle] = {}
    for item in stream:
        unit = item if isinstance(item, list) else [item]
        if not unit:
            continue
        layer = _layer_of(unit[0][0])
        for key in [k for k, b in pending.items() if b.layer != layer]:
            yield pending.pop(key).items
        paired = [(member, pair_key(member[0])) for member in unit]
        keys = {p[0] for _, p in paired if p is not None}
        if not keys:
            yield unit
            continue
        key = keys.pop() if len(keys) == 1 else ",".join(sorted(keys))
        bundle = pending.setdefault(key, _Bundle(key, layer, wo_a=key.endswith(".wo_a")))
        for member, pair in paired:
            if pair is None:
                bundle.items.append(member)
            else:
                bundle.add(member, pair[1], pair[2])
        if bundle.complete():
            yield pending.pop(key).items
    for bundle in pending.values():
        yield bundle.items


def iter_buckets(
    stream: Iterable[NamedTensor | list[NamedTensor]], bucket_bytes: int
) -> Iterator[list[NamedTensor]]:
    """Buckets of at most `bucket_bytes` (a unit larger than that travels alone), units and pairs kept whole.

    `stream` yields (name, tensor) pairs, or lists of them that must travel together.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: list[NamedTensor] = []
    size = 0
    for unit in _units(stream):
        unit_bytes = sum(t.numel() * t.element_size() for _, t in unit)
        if bucket and size + unit_bytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.extend(unit)
        size += unit_bytes
    if bucket:
        yield bucket
