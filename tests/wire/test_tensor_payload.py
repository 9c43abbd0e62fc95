"""CUDA handles in the colocated payload name their device by UUID, as SGLang's patched reductions do.

No GPU here: torch's CUDA reduction is replaced by one that returns what it returns on a GPU (torch's
`rebuild_cuda_tensor` and its arguments, the device index 7th), and the pickled payload is read back with an
unpickler that records the rebuild call instead of making it."""

from __future__ import annotations

import base64
import io
import pickle
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing

from dsv4rl.wire import tensor_payload
from dsv4rl.wire.tensor_payload import CUDA_DEVICE_ARG, PayloadError, local_device_index, serialize

reductions = torch.multiprocessing.reductions
UUIDS = ["GPU-0a1b2c3d-0000-0000-0000-000000000000", "GPU-9f8e7d6c-0000-0000-0000-000000000001"]


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(uuid=UUIDS[index]))


def fake_cuda_reduction(tensor: torch.Tensor) -> tuple:
    """What torch's reduce_tensor returns for a tensor on cuda:1 (handles stubbed)."""
    args = (type(tensor), tensor.shape, tensor.stride(), 0, "storage_cls", tensor.dtype, 1, b"handle",
            64, 0, False, b"ref", 0, b"event", True)  # fmt: skip
    return reductions.rebuild_cuda_tensor, args


class RecordingUnpickler(pickle.Unpickler):
    calls: list[tuple] = []

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return lambda *args: self.calls.append(args) or "rebuilt"
        return super().find_class(module, name)


def test_a_cuda_handle_names_its_device_by_uuid(monkeypatch: pytest.MonkeyPatch, two_gpus: None) -> None:
    monkeypatch.setattr(reductions, "reduce_tensor", fake_cuda_reduction)
    payload = serialize([("layers.0.attn.wq_a.weight", torch.zeros(2, 3))])
    RecordingUnpickler.calls = []
    assert RecordingUnpickler(io.BytesIO(base64.b64decode(payload))).load() == [
        ("layers.0.attn.wq_a.weight", "rebuilt")
    ]
    (args,) = RecordingUnpickler.calls
    assert args[CUDA_DEVICE_ARG] == UUIDS[1]  # cuda:1 in the trainer's numbering, by its UUID
    assert args[CUDA_DEVICE_ARG + 1] == b"handle" and args[5] == torch.float32  # the rest untouched


def test_the_engine_rebuilds_on_the_gpu_the_uuid_names(
    monkeypatch: pytest.MonkeyPatch, two_gpus: None
) -> None:
    """The engine's own numbering decides: the UUID of the trainer's cuda:1 may be the engine's cuda:0."""
    assert local_device_index(UUIDS[1]) == 1 and local_device_index(UUIDS[0]) == 0
    assert local_device_index(1) == 1  # an index (a trainer without SGLang's patch) passes as it is
    with pytest.raises(PayloadError, match="cannot see .*CUDA_VISIBLE_DEVICES"):
        local_device_index("GPU-ffffffff-0000-0000-0000-000000000009")
    rebuilt = []
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", lambda *args: rebuilt.append(args) or "tensor")
    _, args = fake_cuda_reduction(torch.zeros(1))
    args = (*args[:CUDA_DEVICE_ARG], UUIDS[0], *args[CUDA_DEVICE_ARG + 1 :])
    assert (
        tensor_payload._SafeUnpickler.allowed[("torch.multiprocessing.reductions", "rebuild_cuda_tensor")](
            *args
        )
        == "tensor"
    )
    assert rebuilt[0][CUDA_DEVICE_ARG] == 0


def test_cpu_tensors_are_pickled_as_torch_pickles_them() -> None:
    """Only the CUDA reduction changes: CPU storages still travel as shared-memory segments."""
    bucket = [("norm.weight", torch.arange(4.0))]
    payload, buffer = tensor_payload.pack_bucket(bucket, None, torch.device("cpu"))
    opened = tensor_payload.named_tensors(tensor_payload.deserialize(serialize(payload)), None)
    assert opened[0][0] == "norm.weight" and torch.equal(opened[0][1], torch.arange(4.0))
    del buffer
