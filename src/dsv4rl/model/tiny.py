"""The tiny DeepSeek-V4 model: transformers' DeepseekV4ForCausalLM at toy size, built from a seed.

It covers every layer type of the real model (sliding, CSA and HCA attention; hash-routed and
score-routed MoE; mHC with 4 streams) so the whole loop exercises the real architecture on a CPU.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM, PreTrainedTokenizerFast
from transformers.utils import logging as transformers_logging

from dsv4rl.config.schema import (
    LAYER_TYPES,
    MLP_TYPES,
    ExpertScaleDtype,
    ModelConfig,
    QuantConfig,
    TinyModelConfig,
)
from dsv4rl.model.native_checkpoint import load_native_model, write_native_checkpoint
from dsv4rl.model.tokenizer import build_char_tokenizer
from dsv4rl.quant.formats import WireFormat


def tiny_hf_config(tiny: TinyModelConfig, vocab_size: int) -> DeepseekV4Config:
    """The transformers config for `tiny`; eager attention (the only one V4 supports)."""
    unknown = set(tiny.layer_types) - set(LAYER_TYPES)
    if unknown:
        raise ValueError(f"unknown layer_types {sorted(unknown)}; choose from {list(LAYER_TYPES)}")
    unknown = set(tiny.mlp_layer_types) - set(MLP_TYPES)
    if unknown:
        raise ValueError(f"unknown mlp_layer_types {sorted(unknown)}; choose from {list(MLP_TYPES)}")
    if len(tiny.layer_types) != tiny.num_hidden_layers or len(tiny.mlp_layer_types) != tiny.num_hidden_layers:
        raise ValueError(
            f"model.tiny.layer_types ({len(tiny.layer_types)}) and mlp_layer_types "
            f"({len(tiny.mlp_layer_types)}) must both list num_hidden_layers={tiny.num_hidden_layers} entries"
        )
    config = DeepseekV4Config(
        vocab_size=vocab_size,
        hidden_size=tiny.hidden_size,
        moe_intermediate_size=tiny.moe_intermediate_size,
        num_hidden_layers=tiny.num_hidden_layers,
        num_attention_heads=tiny.num_attention_heads,
        num_key_value_heads=1,
        head_dim=tiny.head_dim,
        qk_rope_head_dim=tiny.qk_rope_head_dim,
        q_lora_rank=tiny.q_lora_rank,
        o_groups=tiny.o_groups,
        o_lora_rank=tiny.o_lora_rank,
        n_routed_experts=tiny.n_routed_experts,
        n_shared_experts=tiny.n_shared_experts,
        num_experts_per_tok=tiny.num_experts_per_tok,
        layer_types=list(tiny.layer_types),
        mlp_layer_types=list(tiny.mlp_layer_types),
        compress_rates={
            "compressed_sparse_attention": tiny.csa_compress_rate,
            "heavily_compressed_attention": tiny.hca_compress_rate,
        },
        sliding_window=tiny.sliding_window,
        index_n_heads=tiny.index_n_heads,
        index_head_dim=tiny.index_head_dim,
        index_topk=tiny.index_topk,
        hc_mult=tiny.hc_mult,
        hc_sinkhorn_iters=tiny.hc_sinkhorn_iters,
        max_position_embeddings=tiny.max_position_embeddings,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    config._attn_implementation = "eager"
    return config


@torch.no_grad()
def randomize_hash_routing(model: DeepseekV4ForCausalLM, generator: torch.Generator) -> None:
    """HF starts tid2eid at zeros (every token -> expert 0): give each token k distinct experts."""
    config = model.config
    for layer in model.model.layers:
        table = getattr(layer.mlp.gate, "tid2eid", None)
        if table is None:
            continue
        scores = torch.rand(config.vocab_size, config.n_routed_experts, generator=generator)
        table.copy_(scores.topk(config.num_experts_per_tok, dim=-1).indices.to(table.dtype))


def build_tiny_model(model_config: ModelConfig, vocab_size: int) -> DeepseekV4ForCausalLM:
    """Random init from `model_config.init_seed`, fp32, with a real hash-routing table."""
    config = tiny_hf_config(model_config.tiny, vocab_size)
    generator = torch.Generator().manual_seed(model_config.init_seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(model_config.init_seed)
        model = DeepseekV4ForCausalLM(config)
    randomize_hash_routing(model, generator)
    return model.to(torch.float32).eval()


def load_tokenizer(model_config: ModelConfig) -> PreTrainedTokenizerFast:
    if model_config.tokenizer == "arith_chars":
        return build_char_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_config.tokenizer)


def load_model(model_config: ModelConfig, vocab_size: int | None = None) -> DeepseekV4ForCausalLM:
    """The tiny model from its seed, or the checkpoint at `model_config.path` (native or transformers)."""
    if model_config.path is None:
        if vocab_size is None:
            vocab_size = len(load_tokenizer(model_config))
        return build_tiny_model(model_config, vocab_size)
    dtype = torch.float32 if model_config.dtype.value == "float32" else torch.bfloat16
    return load_native_model(model_config.path, dtype)


def checkpoint_wire_format(quant: QuantConfig) -> WireFormat:
    """The format a checkpoint of `quant` is written in (expert scales E8M0, like the release, unless set)."""
    scale = torch.float32 if quant.expert_scale_dtype == ExpertScaleDtype.float32 else torch.float8_e8m0fnu
    return WireFormat(quant.name, tuple(quant.block_size), scale)


MANIFEST_FILE = "dsv4rl-model.json"


class ModelDirMismatch(ValueError):
    """A model directory built earlier from other settings than the recipe's."""


def source_model_dir(run_dir: str | Path) -> Path:
    """`dsv4rl align` with the tiny model: the unquantized weights the trainer holds (quant=none)."""
    return Path(run_dir) / "model-source"


def materialize_model(model_config: ModelConfig, directory: str, quant: QuantConfig | None = None) -> str:
    """Write the tiny model as a native DeepSeek-V4 checkpoint in `quant`'s format, with its tokenizer.

    The tiny model has no checkpoint to download: the launcher builds it from its seed once, and engines
    and trainers load the same files, exactly as they would the released checkpoint. A directory built
    before is reused only when it was built from the same settings (recorded in dsv4rl-model.json).
    """
    quant = quant if quant is not None else QuantConfig()
    target = Path(directory)
    if check_model_dir(model_config, target, quant):
        return str(target)
    tokenizer = load_tokenizer(model_config)
    model = load_model(model_config, vocab_size=len(tokenizer))
    _remove_stale_partials(target)
    # One build dir per process: the nodes of a multi-node run share the run dir and build at the same time.
    partial = target.with_name(f"{target.name}.partial-{socket.gethostname()}-{os.getpid()}")
    transformers_logging.disable_progress_bar()  # the supervisor's own display is on screen
    write_native_checkpoint(model, partial, checkpoint_wire_format(quant))
    tokenizer.save_pretrained(partial)
    (partial / MANIFEST_FILE).write_text(_manifest(model_config, quant))
    try:
        partial.rename(target)
    except OSError:  # another node was first; its copy is built from the same seed and settings
        shutil.rmtree(partial)
        if not check_model_dir(model_config, target, quant):
            raise
    return str(target)


def _remove_stale_partials(target: Path) -> None:
    """Builds interrupted earlier on this host; a live process's build, or another host's, is left alone."""
    prefix, ours = f"{target.name}.partial", f"-{socket.gethostname()}-"
    for stale in target.parent.glob(f"{prefix}*"):
        owner = stale.name.removeprefix(prefix)  # "" (older builds) or "-<host>-<pid>"
        if owner.startswith(ours):
            pid = owner.rsplit("-", 1)[-1]
            if pid.isdigit() and _process_alive(int(pid)):
                continue
        elif owner:
            continue
        shutil.rmtree(stale, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _manifest(model_config: ModelConfig, quant: QuantConfig) -> str:
    keys = {"name": quant.name.value, "block_size": list(quant.block_size)}
    keys["expert_scale_dtype"] = quant.expert_scale_dtype.value
    return json.dumps({"model": asdict(model_config), "quant": keys}, sort_keys=True, default=str)


def check_model_dir(model_config: ModelConfig, directory: str | Path, quant: QuantConfig) -> bool:
    """True when `directory` already holds this model in this format; ModelDirMismatch when it holds
    another; False when there is nothing to reuse."""
    target = Path(directory)
    if not (target / "config.json").exists():
        return False
    built = (target / MANIFEST_FILE).read_text() if (target / MANIFEST_FILE).exists() else None
    if built != _manifest(model_config, quant):
        raise ModelDirMismatch(
            f"{target} holds a model built from other settings (model.* or quant=) than this recipe's "
            f"(quant={quant.name.value}); choose a new run.dir, or delete that directory to rebuild it"
        )
    return True
