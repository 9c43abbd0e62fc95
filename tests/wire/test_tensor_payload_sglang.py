"""The colocated payload as SGLang 0.5.23 itself opens it: the released wheel's MultiprocessingSerializer
(its allow-listing SafeUnpickler) and FlattenedTensorBucket, in SGLang's own interpreter and torch
(`tests/sglang_runner.py`), rebuild the tensors the trainer shared, bit for bit, in both load formats."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from dsv4rl.wire.layout import sort_for_flattening
from dsv4rl.wire.tensor_payload import pack_bucket, serialize
from sglang_runner import needs_sglang

pytestmark = [*needs_sglang, pytest.mark.slow]


def test_sglang_opens_the_payload_bit_for_bit(tmp_path: Path, sglang_sides) -> None:
    generator = torch.Generator().manual_seed(0)
    bucket = sort_for_flattening([
        ("layers.0.attn.wq_a.weight", torch.randn(8, 4, generator=generator).to(torch.float8_e4m3fn)),
        ("layers.0.attn.wq_a.scale", torch.full((1, 1), 0.25).to(torch.float8_e8m0fnu)),
        ("layers.0.ffn.experts.0.w1.weight", torch.randint(-128, 127, (4, 2), dtype=torch.int8)),
        ("layers.0.ffn.gate.tid2eid", torch.randint(0, 8, (3, 2), generator=generator)),
        ("norm.weight", torch.randn(5, generator=generator).to(torch.bfloat16)),
        ("hc_head_base", torch.randn(4, generator=generator)),
    ])  # fmt: skip
    keep, entries = [], {}
    for load_format in ("null", "flattened_bucket"):
        payload, buffer = pack_bucket(
            bucket, None if load_format == "null" else load_format, torch.device("cpu")
        )
        keep.append(buffer)  # alive until SGLang's side has opened it
        entries[load_format] = serialize(payload)
    (tmp_path / "payloads.json").write_text(json.dumps(entries))
    opened = sglang_sides.get().call("tensor_payload:open_payloads", path=str(tmp_path / "payloads.json"))
    expected = {
        name: [str(t.dtype), list(t.shape), t.contiguous().view(torch.uint8).flatten().tolist()]
        for name, t in bucket
    }
    assert opened == {"null": expected, "flattened_bucket": expected}


def test_sglang_reads_the_device_where_the_payload_puts_its_uuid(tmp_path: Path, sglang_sides) -> None:
    """SGLang's patched rebuild reads the device at the argument the trainer replaces; with a GPU on both
    sides, SGLang opens a CUDA payload whose handle names the device by UUID."""
    from dsv4rl.wire.tensor_payload import CUDA_DEVICE_ARG

    path, keep, env = None, None, {}
    if torch.cuda.is_available():  # SGLang's side then sees the GPU too (the group's workers see none)
        payload, keep = pack_bucket([("norm.weight", torch.arange(4.0))], None, torch.device("cuda", 0))
        path = tmp_path / "payload.json"
        path.write_text(json.dumps(serialize(payload)))
        env = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}
    opened = sglang_sides.get(env).call("tensor_payload:device_arg", path=None if path is None else str(path))
    assert opened["device_arg"] == CUDA_DEVICE_ARG
    if keep is not None:
        assert opened["values"] == {"norm.weight": [0.0, 1.0, 2.0, 3.0]}
