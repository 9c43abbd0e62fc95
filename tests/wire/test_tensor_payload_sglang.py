"""The colocated payload as SGLang 0.5.23 itself opens it: the released wheel's MultiprocessingSerializer
(its allow-listing SafeUnpickler) and FlattenedTensorBucket, in the SGLang environment's own interpreter and
torch (`make install-sglang`), rebuild the tensors the trainer shared, bit for bit, in both load formats.
Skipped where that environment is not installed; ~30 s (importing sglang)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from dsv4rl.wire.layout import sort_for_flattening
from dsv4rl.wire.tensor_payload import pack_bucket, serialize

SGLANG_PYTHON = Path(__file__).resolve().parents[2] / ".venv-sglang" / "bin" / "python"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason="no .venv-sglang (make install-sglang)"),
]

OPEN = """
import json, sys, torch
from sglang.srt.utils.common import MultiprocessingSerializer, normalize_serialized_named_tensor_payload
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata
out = {}
for fmt, entry in json.load(open(sys.argv[1])).items():
    obj = MultiprocessingSerializer.deserialize(normalize_serialized_named_tensor_payload(entry))
    if fmt == "flattened_bucket":  # as model_runner's _update_weights_from_flattened_bucket converts it
        meta = [FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx,
                                        end_idx=m.end_idx, numel=m.numel) for m in obj["metadata"]]
        bucket = FlattenedTensorBucket(flattened_tensor=obj["flattened_tensor"], metadata=meta)
        obj = bucket.reconstruct_tensors()
    out[fmt] = {name: [str(t.dtype), list(t.shape), t.contiguous().view(torch.uint8).flatten().tolist()]
                for name, t in obj}
print(json.dumps(out))
"""


def test_sglang_opens_the_payload_bit_for_bit(tmp_path: Path) -> None:
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
    script = tmp_path / "open.py"
    script.write_text(OPEN)
    result = subprocess.run(
        [str(SGLANG_PYTHON), str(script), str(tmp_path / "payloads.json")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    opened = json.loads(result.stdout.strip().splitlines()[-1])
    expected = {
        name: [str(t.dtype), list(t.shape), t.contiguous().view(torch.uint8).flatten().tolist()]
        for name, t in bucket
    }
    assert opened == {"null": expected, "flattened_bucket": expected}


UUID_CHECK = """
import json, sys, torch
from sglang.srt.utils.common import MultiprocessingSerializer, normalize_serialized_named_tensor_payload
from sglang.srt.utils.patch_torch import _REDUCE_TENSOR_ARG_DEVICE_INDEX, monkey_patch_torch_reductions
out = {"device_arg": _REDUCE_TENSOR_ARG_DEVICE_INDEX, "values": None}
if len(sys.argv) > 1:  # a CUDA payload: opened as SGLang's scheduler opens it (its reductions patched)
    monkey_patch_torch_reductions()
    entry = json.load(open(sys.argv[1]))
    obj = MultiprocessingSerializer.deserialize(normalize_serialized_named_tensor_payload(entry))
    out["values"] = {name: t.cpu().tolist() for name, t in obj}
print(json.dumps(out))
"""


def test_sglang_reads_the_device_where_the_payload_puts_its_uuid(tmp_path: Path) -> None:
    """SGLang's patched rebuild reads the device at the argument the trainer replaces; with a GPU on both
    sides, SGLang opens a CUDA payload whose handle names the device by UUID."""
    from dsv4rl.wire.tensor_payload import CUDA_DEVICE_ARG

    script = tmp_path / "uuid.py"
    script.write_text(UUID_CHECK)
    argv = [str(SGLANG_PYTHON), str(script)]
    keep = None
    if torch.cuda.is_available():
        payload, keep = pack_bucket([("norm.weight", torch.arange(4.0))], None, torch.device("cuda", 0))
        (tmp_path / "payload.json").write_text(json.dumps(serialize(payload)))
        argv.append(str(tmp_path / "payload.json"))
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    opened = json.loads(result.stdout.strip().splitlines()[-1])
    assert opened["device_arg"] == CUDA_DEVICE_ARG
    if keep is not None:
        assert opened["values"] == {"norm.weight": [0.0, 1.0, 2.0, 3.0]}
