"""Native DeepSeek-V4 checkpoints: the released layout, written and read by dsv4rl.

A native checkpoint directory holds
- safetensors with the release's tensor names (`embed.weight`, `layers.N.attn.wq_a.weight`,
  `layers.N.ffn.experts.E.w1.weight`, ...), dtypes and shapes, quantized tensors followed by their
  `.scale` (see `dsv4rl.model.wire_format` for which tensor gets which format);
- `config.json`, the transformers config plus the release's keys that SGLang reads instead
  (`compress_ratios`, `num_hash_layers`, `rope_scaling`, `torch_dtype`, ...: `dsv4rl.model.release_config`),
  with the release's `quantization_config` when quantized (`{"quant_method": "fp8", "fmt": "e4m3",
  "scale_fmt": "ue8m0", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}`; the release does
  not say how experts are stored, loaders read the safetensors dtype).
This is what SGLang loads, what the reference engine holds, and what the trainer starts from: the trainer
dequantizes it to its training dtype (`load_native_model`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from dsv4rl.config.choices import Dtype, QuantMode
from dsv4rl.model.naming import (
    CheckpointKind,
    checkpoint_kind,
    copy_native_into,
    scale_name,
    state_dict_to_native,
)
from dsv4rl.model.release_config import (
    ReleaseConfigError,
    check_release_keys,
    transformers_keys_for_loading,
    with_release_keys,
)
from dsv4rl.model.sinkhorn import use_fast_sinkhorn
from dsv4rl.model.wire_format import WireFormat
from dsv4rl.quant.formats import dequantize
from dsv4rl.quant.fp8 import DEFAULT_BLOCK, E4M3
from dsv4rl.quant.scales import E8M0
from dsv4rl.quant.sglang_env import FP8, MXFP4, UNQUANTIZED

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
ARCHITECTURE = "DeepseekV4ForCausalLM"
TORCH_DTYPES = {Dtype.float32: torch.float32, Dtype.bfloat16: torch.bfloat16}  # model.dtype
_SAFETENSORS_DTYPES = {
    "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F8_E4M3": E4M3, "F8_E8M0": E8M0,
    "I8": torch.int8, "U8": torch.uint8, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
}  # fmt: skip


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read as a DeepSeek-V4 model; the message names what is wrong."""


def quantization_config(wire_format: WireFormat) -> dict | None:
    """The release's `quantization_config` for the quantized modes, None for unquantized checkpoints."""
    if not wire_format.quantized:
        return None
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "scale_fmt": "ue8m0",
        "weight_block_size": list(wire_format.block),
        "activation_scheme": "dynamic",
    }


# ------------------------------------------------------------------------------------------------ write
@torch.no_grad()
def write_native_checkpoint(
    model: DeepseekV4ForCausalLM, directory: str | Path, wire_format: WireFormat
) -> Path:
    """`model` as a native checkpoint in `wire_format` (one safetensors file and config.json)."""
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    encoded = wire_format.encode_all(state_dict_to_native(model.state_dict()))
    tensors = {name: t.contiguous().clone() for name, t in encoded.items()}  # experts are views of one tensor
    save_file(tensors, str(target / WEIGHTS_FILE), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["architectures"] = [ARCHITECTURE]
    config.pop("_attn_implementation_internal", None)
    config = with_release_keys(config, checkpoint_dtype(model, wire_format))
    quant = quantization_config(wire_format)
    if quant is not None:
        config["quantization_config"] = quant
    (target / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return target


def checkpoint_dtype(model: DeepseekV4ForCausalLM, wire_format: WireFormat) -> str:
    """The release's `torch_dtype` of a checkpoint: the model's own dtype unquantized (`quant=none`), else
    bfloat16, that of its unquantized linears (as in the release; SGLang's `--dtype auto` serves it)."""
    if wire_format.mode == QuantMode.none:
        return str(next(model.parameters()).dtype).removeprefix("torch.")
    return "bfloat16"


# ------------------------------------------------------------------------------------------------ read
def checkpoint_files(directory: str | Path) -> list[Path]:
    """Safetensors files of a checkpoint: the index's shards, model.safetensors, or every *.safetensors."""
    root = Path(directory)
    index = root / INDEX_FILE
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [root / shard for shard in shards]
    if (root / WEIGHTS_FILE).is_file():
        return [root / WEIGHTS_FILE]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{root} has no safetensors files: point model.path at a model directory")
    return files


def tensor_dtypes(directory: str | Path) -> dict[str, torch.dtype]:
    """Every tensor's dtype, read from the safetensors headers only."""
    dtypes: dict[str, torch.dtype] = {}
    for path in checkpoint_files(directory):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                dtype = handle.get_slice(name).get_dtype()
                dtypes[name] = _SAFETENSORS_DTYPES.get(dtype, dtype)
    return dtypes


def read_tensors(directory: str | Path, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Tensors of the checkpoint (all, or `names`), on CPU, in their stored dtype."""
    wanted = None if names is None else set(names)
    tensors: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(directory):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118
                if wanted is None or name in wanted:
                    tensors[name] = handle.get_tensor(name)
    return tensors


def is_native_checkpoint(directory: str | Path) -> bool:
    """True for the release's naming (`embed.weight`), False for a transformers `save_pretrained` dir."""
    try:
        return "embed.weight" in tensor_dtypes(directory)
    except CheckpointError:
        return False


def read_config(directory: str | Path) -> dict:
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{directory} has no {CONFIG_FILE}: point model.path at a model directory")
    return json.loads(path.read_text())


def block_size(config: Mapping) -> tuple[int, int]:
    block = (config.get("quantization_config") or {}).get("weight_block_size") or DEFAULT_BLOCK
    return (int(block[0]), int(block[1]))


@dataclass(frozen=True)
class CheckpointFormat:
    """What a checkpoint stores, read from its headers: the quant mode it matches and its expert layout."""

    mode: QuantMode | None  # None: a layout none of the quant modes produces
    linear_dtype: torch.dtype
    experts: str  # MXFP4, FP8 or UNQUANTIZED (dsv4rl.quant.sglang_env)
    expert_scale_dtype: torch.dtype | None
    block: tuple[int, int]

    def describe(self) -> str:
        name = self.mode.value if self.mode is not None else "an unrecognised layout"
        scale = (
            f", expert scales {str(self.expert_scale_dtype).removeprefix('torch.')}"
            if self.expert_scale_dtype
            else ""
        )
        return (
            f"{name} (linears {str(self.linear_dtype).removeprefix('torch.')}, experts {self.experts}{scale})"
        )


def checkpoint_format(directory: str | Path) -> CheckpointFormat:
    """Classify a native checkpoint by the dtypes of its first FP8-class linear and first routed expert."""
    dtypes = tensor_dtypes(directory)
    linear = next((n for n in dtypes if checkpoint_kind(n) == CheckpointKind.fp8_linear), None)
    expert = next((n for n in dtypes if checkpoint_kind(n) == CheckpointKind.routed_expert), None)
    if linear is None or expert is None:
        raise CheckpointError(
            f"{directory} is not a native DeepSeek-V4 checkpoint: no attention linear or routed expert under "
            "the release's names (layers.N.attn.wq_a.weight, layers.N.ffn.experts.E.w1.weight)"
        )
    linear_dtype, expert_dtype = dtypes[linear], dtypes[expert]
    expert_scale = dtypes.get(scale_name(expert))
    experts = {torch.int8: MXFP4, torch.uint8: MXFP4, E4M3: FP8}.get(expert_dtype, UNQUANTIZED)
    mode: QuantMode | None = None
    if linear_dtype == E4M3 and experts == MXFP4:
        mode = QuantMode.fp8_mxfp4
    elif linear_dtype == E4M3 and experts == FP8:
        mode = QuantMode.fp8_rollout
    elif linear_dtype == expert_dtype == torch.bfloat16:
        mode = QuantMode.bf16
    elif linear_dtype == expert_dtype == torch.float32:
        mode = QuantMode.none
    return CheckpointFormat(mode, linear_dtype, experts, expert_scale, block_size(read_config(directory)))


# ------------------------------------------------------------------------------------------------ load
def checked_config(directory: str | Path) -> dict:
    """config.json, refused (CheckpointError naming each key) when its release keys and transformers' keys
    state different models: SGLang would serve one, the trainer train the other."""
    config = read_config(directory)
    try:
        check_release_keys(config, f"{Path(directory) / CONFIG_FILE}")
    except ReleaseConfigError as error:
        raise CheckpointError(str(error)) from None
    return config


def load_hf_config(directory: str | Path) -> DeepseekV4Config:
    """The transformers config of a checkpoint, minus its quantization_config (dsv4rl dequantizes itself);
    a config whose two key sets disagree is refused, and transformers reads its own keys where both exist."""
    config = transformers_keys_for_loading(checked_config(directory))
    config.pop("quantization_config", None)
    hf_config = DeepseekV4Config.from_dict(config)
    hf_config._attn_implementation = "eager"  # the only attention transformers' DeepSeek-V4 supports
    return hf_config


def dequantized_native_state(
    tensors: Mapping[str, torch.Tensor], block: tuple[int, int], dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """{weight name: dequantized tensor} from checkpoint tensors; scales are folded into their weights."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith(".scale"):
            continue
        scale = tensors.get(scale_name(name)) if name.endswith(".weight") else None
        out[name] = dequantize(tensor, scale, block, dtype)
    return out


@torch.no_grad()
def load_native_state(model: DeepseekV4ForCausalLM, weights: Mapping[str, torch.Tensor]) -> None:
    """Copy dequantized native tensors into `model`, refusing missing and unknown tensors."""
    expected = {name for name, _ in state_dict_to_native(model.state_dict())}
    missing = sorted(expected - weights.keys())
    unknown = sorted(
        n for n in weights.keys() - expected if not n.startswith("mtp.")
    )  # transformers has no MTP
    if missing or unknown:
        raise CheckpointError(
            f"the checkpoint does not match the model config: {len(missing)} tensors missing "
            f"{missing[:5]}, {len(unknown)} unknown {unknown[:5]}"
        )
    state = model.state_dict(keep_vars=True)
    for name in expected:
        copy_native_into(state, name, weights[name])


def load_native_checkpoint(
    directory: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[DeepseekV4ForCausalLM, dict[str, torch.Tensor]]:
    """(model in `dtype` holding the dequantized weights, the checkpoint's tensors as stored).

    A transformers directory (`save_pretrained`) loads through transformers; its tensors are then the
    model's own, under native names. The mHC modules run their Sinkhorn rounds in
    `dsv4rl.model.sinkhorn` (the same values, a fraction of the time).
    """
    if not is_native_checkpoint(directory):
        checked_config(directory)
        model = DeepseekV4ForCausalLM.from_pretrained(str(directory), dtype=dtype)
        model.config._attn_implementation = "eager"
        use_fast_sinkhorn(model)
        stored = {name: t.detach().clone() for name, t in state_dict_to_native(model.state_dict())}
        return model.eval(), stored
    config = load_hf_config(directory)
    with torch.random.fork_rng(devices=[]):  # the random init is overwritten; keep the caller's RNG intact
        model = DeepseekV4ForCausalLM(config)
    stored = read_tensors(directory)
    load_native_state(model, dequantized_native_state(stored, block_size(read_config(directory))))
    use_fast_sinkhorn(model)
    return model.to(dtype).eval(), stored


def load_native_model(directory: str | Path, dtype: torch.dtype = torch.float32) -> DeepseekV4ForCausalLM:
    """A transformers DeepSeek-V4 model in `dtype` from a native checkpoint (or a transformers directory)."""
    return load_native_checkpoint(directory, dtype)[0]
