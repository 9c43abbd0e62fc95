"""SGLang 0.5.23's DeepseekV4ForCausalLM as an engine holds it, built on CPU, and a weight push into it.

`load_and_push` does what one SGLang scheduler does, with SGLang's own code at every step:
- start-up: `ServerArgs` -> `runtime_context.publish` -> gloo process groups -> `ModelConfig` ->
  `model_loader.get_model` (the quantization config from the checkpoint, `load_weights` over the model
  directory's safetensors, then `process_weights_after_loading`, where `SGLANG_DSV4_FP4_DEQUANT=1` turns
  MXFP4 experts into FP8);
- a push, as `model_runner_components/weight_updater.py` runs one: `begin_weight_update`
  (`DefaultModelLoader.restore_weights_before_loading`), then per request the tensors rebuilt from the
  request's names, dtypes and shapes (`FlattenedTensorBucket` for `load_format="flattened_bucket"`, else
  one `torch.empty` per name, filled with the bytes a broadcast would have written) and
  `model.load_weights` on them, then `end_weight_update` (`DefaultModelLoader.postprocess_weights`).
The only thing not run is the broadcast itself: the bytes come from files the test wrote.

Every parameter is written to safetensors after start-up and after the push; warnings SGLang logged
while loading come back (a name it cannot place is only a warning there: "... not found in params_dict").
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

_state: dict[str, object] = {}


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.name}: {record.getMessage()}")


def _process_groups(server_args) -> None:
    """One scheduler rank (TP 1) with gloo groups; created once per process, re-published per model."""
    from sglang.srt import runtime_context
    from sglang.srt.distributed import parallel_state

    runtime_context.publish(server_args, role="scheduler", ranks=runtime_context.SpawnRanks(world_rank=0))
    if not _state.get("groups"):
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        parallel_state.init_distributed_environment(
            world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}", local_rank=0,
            backend="gloo",
        )  # fmt: skip
        parallel_state.initialize_model_parallel(backend="gloo")
        _state["groups"] = True


def start_engine(model_path: str, dtype: str):
    """The model as `sglang.launch_server --model-path model_path --dtype dtype` loads it (TP 1, CPU)."""
    import cpu_patches
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader import get_model
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path=model_path, device="cpu", dtype=dtype)
    _process_groups(server_args)
    cpu_patches.install()
    model_config = ModelConfig.from_server_args(server_args)
    return get_model(
        model_config=model_config,
        load_config=LoadConfig(load_format=server_args.load_format),
        device_config=DeviceConfig("cpu"),
    )


def _received(meta: dict, payload: bytes):
    """The named tensors one `/update_weights_from_distributed` request yields on SGLang's side."""
    import torch
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    names, dtypes, shapes = meta["names"], meta["dtypes"], meta["shapes"]
    flat = (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if payload
        else torch.empty(0, dtype=torch.uint8)
    )
    if meta.get("load_format") == "flattened_bucket":
        bucket = FlattenedTensorBucket.empty(names, dtypes, shapes, "cpu")
        bucket.get_flattened_tensor().copy_(flat)  # what the broadcast writes into SGLang's buffer
        return bucket.reconstruct_tensors()
    weights, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        weight = torch.empty(shape, dtype=getattr(torch, dtype))  # as receive_weights_from_distributed
        size = weight.numel() * weight.element_size()
        weight.view(-1).view(torch.uint8).copy_(flat[offset : offset + size])
        offset += size
        weights.append((name, weight))
    return weights


def _dump(model, path: Path) -> dict[str, list]:
    from safetensors.torch import save_file

    params = {name: p.detach().contiguous().clone() for name, p in model.named_parameters()}
    save_file(params, str(path))
    return {name: [str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in params.items()}


def load_and_push(model_path: str, dtype: str, push_dir: str | None, out_dir: str) -> dict:
    """Start an engine from `model_path`, write its parameters (`startup.safetensors`), run the push whose
    requests `push_dir/requests.json` lists (payload bytes in `push_dir/<i>.bin`), write them again
    (`pushed.safetensors`). An error SGLang raises propagates, as it would fail the request."""
    import torch
    from sglang.srt.model_loader.loader import DefaultModelLoader

    out = Path(out_dir)
    logs = _Warnings()
    logging.getLogger().addHandler(logs)
    try:
        started = time.perf_counter()
        model = start_engine(model_path, dtype)
        result = {
            "startup_s": time.perf_counter() - started,
            "params": _dump(model, out / "startup.safetensors"),
        }
        result["startup_warnings"], logs.messages = logs.messages, []
        if push_dir is not None:
            device = torch.device("cpu")
            requests = json.loads((Path(push_dir) / "requests.json").read_text())
            DefaultModelLoader.restore_weights_before_loading(model, device)  # begin_weight_update
            for index, meta in enumerate(requests):
                payload = (Path(push_dir) / f"{index}.bin").read_bytes()
                model.load_weights(_received(meta, payload))  # load_weights_from_distributed
            DefaultModelLoader.postprocess_weights(model, device)  # end_weight_update (weights loaded)
            _dump(model, out / "pushed.safetensors")
            result["push_warnings"] = logs.messages
        return result
    finally:
        logging.getLogger().removeHandler(logs)
