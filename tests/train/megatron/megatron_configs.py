"""Every shipped recipe with every shipped parallel layout, on either trainer backend: validated as on a GPU
node (the recipe rules and the Transformer Engine rule of `dsv4rl.checks.machine`, with this environment's
TE), then megatron-core's own configs built as the megatron backend builds them
(`dsv4rl.train.megatron.backend.megatron_configs`), for a CPU and for a GPU, and on the tiny model the
optimizer constructed as far as this machine allows. In a process of its own (a world of 1: megatron's
optimizer gathers its parameter groups over the world). Usage: megatron_configs.py OUT.jsonl; one JSON
line per case, for test_megatron_configs.py.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel
from transformers import DeepseekV4Config

from dsv4rl.checks.machine import transformer_engine_problem
from dsv4rl.checks.validate import validate
from dsv4rl.config.choices import TrainBackend
from dsv4rl.config.compose import ConfigError, compose, list_groups, list_recipes
from dsv4rl.config.schema import Config
from dsv4rl.model.model_dir import materialize_model
from dsv4rl.train.megatron import backend as megatron_backend
from dsv4rl.train.megatron.optimizer import MegatronDistributedAdam, ModelParallelAdamW, build_optimizer
from dsv4rl.train.megatron.parallel import build_stage, initialize

# where megatron-core 0.16.1 first needs CUDA when it builds the distributed optimizer on a CPU: the
# mixed-precision wrapper's flag tensors, or the offloading optimizer's copy streams
CUDA_STOPS = {
    ("megatron/core/optimizer/optimizer.py", "__init__"),
    ("megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py", "_init_sub_optimizers"),
}


def cases() -> list[tuple[str, str, str]]:
    """(recipe, parallel layout, backend): each shipped recipe with each shipped layout, on both backends."""
    layouts = list_groups()["parallel"]
    return [(r, p, b.value) for r in list_recipes() for p in layouts for b in TrainBackend]


def recipe_hf_config(cfg: Config, tiny_dir: Path) -> DeepseekV4Config:
    """The transformers config the backend reads from model.path: the tiny model's own directory, or (a
    release model, not on this machine) transformers' DeepSeek-V4 config with the shapes the recipe states,
    whose defaults are DeepSeek-V4-Flash's."""
    if cfg.model.path is None:
        return megatron_backend.weight_source(str(tiny_dir))[0]
    m = cfg.model
    stated = {
        "num_hidden_layers": m.num_hidden_layers,
        "n_routed_experts": m.n_routed_experts,
        "hidden_size": m.hidden_size,
        "vocab_size": m.vocab_size,
        "num_attention_heads": m.num_attention_heads,
        "head_dim": m.head_dim,
        "moe_intermediate_size": m.moe_intermediate_size,
        "num_experts_per_tok": m.num_experts_per_tok,
        "n_shared_experts": m.n_shared_experts,
        "hc_mult": m.hc_mult,
    }
    return DeepseekV4Config(**{key: value for key, value in stated.items() if value is not None})


def cuda_stop(exc: BaseException) -> str | None:
    """'file:function' of megatron's frame that raised for want of CUDA, if that is why it raised."""
    if "CUDA" not in str(exc) and "NVIDIA" not in str(exc):
        return None
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        path = frame.filename.replace(os.sep, "/")
        for file, function in CUDA_STOPS:
            if path.endswith(file) and frame.name == function:
                return f"{file}:{function}"
    return None


def construct(cfg: Config, hf_config: DeepseekV4Config, row: dict) -> None:
    """The tiny model's stage, megatron's DDP wrapper and the optimizer of each device, on this CPU."""
    if cfg.model.path is not None:
        return  # a release model does not fit here: its configs are what can be checked
    sizes = megatron_backend.parallel_sizes(cfg)
    if (sizes.tensor, sizes.pipeline, sizes.expert) != (1, 1, 1):
        return  # one process here: a stage of a model-parallel layout is built by the torchrun tests
    initialize(sizes)

    cpu, gpu = (megatron_backend.megatron_configs(cfg, hf_config, on_gpu) for on_gpu in (False, True))
    dtype = cpu.transformer.params_dtype
    model = build_stage(hf_config, sizes, dtype, cpu.transformer)
    ddp = DistributedDataParallel(model.config, cpu.ddp, model)
    optimizer = build_optimizer(ddp, cfg, cpu.optimizer)
    row["cpu_optimizer"] = type(optimizer).__name__
    assert isinstance(optimizer, ModelParallelAdamW)
    # the GPU path: megatron's own optimizer over a DDP wrapper with the distributed optimizer's buffers
    model = build_stage(hf_config, sizes, dtype, megatron_backend.stage_config(cfg, hf_config, on_gpu=False))
    ddp = DistributedDataParallel(model.config, gpu.ddp, model)
    try:
        built = build_optimizer(ddp, cfg, gpu.optimizer)
        assert isinstance(built, MegatronDistributedAdam)
        row["gpu_optimizer"] = "built"
    except Exception as exc:
        stop = cuda_stop(exc)
        if stop is None:
            raise
        row["gpu_optimizer"] = f"stopped for CUDA at {stop}"


def build_configs(cfg: Config, hf_config: DeepseekV4Config) -> dict[str, str | None]:
    """megatron's configs of `cfg` for a CPU and for a GPU: None where they build, else the error."""
    built: dict[str, str | None] = {}
    for device in ("cpu", "gpu"):
        try:
            megatron_backend.megatron_configs(cfg, hf_config, on_gpu=device == "gpu")
            built[device] = None
        except Exception as exc:
            built[device] = f"{type(exc).__name__}: {exc}"
    return built


def main() -> None:
    out = Path(sys.argv[1])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    with tempfile.TemporaryDirectory() as tmp, out.open("w") as results:
        tiny_dir = Path(materialize_model(compose("tiny_arith").model, str(Path(tmp) / "tiny")))
        for recipe, layout, backend in cases():
            overrides = [f"parallel={layout}", f"parallel.train.backend={backend}"]
            row: dict = {"recipe": recipe, "layout": layout, "backend": backend, "problems": [], "built": {}}
            cfg = compose(recipe, overrides)
            try:
                validate(cfg, check_paths=False)
            except ConfigError as exc:
                row["problems"] = list(exc.problems)
            te_problem = transformer_engine_problem(cfg)  # the machine rule, as on a GPU node
            if te_problem is not None:
                row["problems"].append(te_problem)
            if backend == TrainBackend.megatron:
                hf_config = recipe_hf_config(cfg, tiny_dir)
                row["built"] = build_configs(cfg, hf_config)  # refused or not: a refusal must be needed
                if not row["problems"]:
                    try:
                        construct(cfg, hf_config, row)
                    except Exception as exc:
                        row["construct_error"] = (
                            f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"
                        )
            if te_problem is not None:  # the fix it names: without precision-aware it validates and builds
                fixed = compose(recipe, [*overrides, "parallel.train.precision_aware_optimizer=false"])
                try:
                    validate(fixed, check_paths=False)
                    row["fixed"] = build_configs(fixed, recipe_hf_config(fixed, tiny_dir))
                except ConfigError as exc:
                    row["fixed"] = {"problems": exc.problems}
            results.write(json.dumps(row) + "\n")
            results.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
