"""The reference engine's launch flags: SGLang's flag names, parsed into `ServerArgs` keyword arguments."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

__all__ = ["ServerArgs", "build_parser", "merge_config_file", "parse_args"]


@dataclass
class ServerArgs:
    """The launch flags (SGLang names); reported by /server_info."""

    model_path: str
    tokenizer_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    max_batch_size: int = 256
    random_seed: int | None = None
    weight_version: str = "default"
    api_key: str | None = None
    admin_api_key: str | None = None
    log_level: str = "info"
    num_threads: int | None = None
    served_model_name: str | None = None
    skip_tokenizer_init: bool = False
    skip_server_warmup: bool = False
    dtype: str = "auto"
    tp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1
    context_length: int | None = None
    load_format: str = "auto"
    enable_deterministic_inference: bool = False  # sampling_seed is honoured only with it, as in SGLang
    enable_memory_saver: bool = False  # release_memory_occupation frees memory only with it, as in SGLang
    enable_return_routed_experts: bool = False  # return_routed_experts is answered only with it, as in SGLang
    enable_return_indexer_topk: bool = False  # return_indexer_topk likewise
    # The reference engine's own mode (no SGLang flag): end_weight_update re-lays out the tensors a session
    # did not re-send, as SGLang's post-processing does on ROCm (dsv4rl.quant.sglang_moe).
    emulate_non_idempotent_postprocess: bool = False
    # The reference engine's own rounding mode (not SGLang flags; docs/numerics.md): `exact` float32, or
    # `sglang`, SGLang 0.5.23's rounding points; `numerics_features` narrows them (comma-separated names).
    numerics: str = "exact"
    numerics_features: str | None = None
    enable_fp32_lm_head: bool = False  # SGLang's flag: fp32 logits (with numerics=sglang, no bf16 rounding)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dsv4rl.engine",
        description="CPU reference engine speaking the SGLang 0.5.23 HTTP protocol subset.",
    )
    parser.add_argument(
        "--model-path", "--model", dest="model_path", required=True, help="transformers model dir"
    )
    parser.add_argument("--tokenizer-path", default=None, help="default: the model path")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument(
        "--max-batch-size", "--max-running-requests", dest="max_batch_size", type=int, default=256
    )
    parser.add_argument("--random-seed", type=int, default=None, help="default: a random int")
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--admin-api-key", default=None)
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"]
    )
    parser.add_argument(
        "--num-threads", type=int, default=None, help="torch intra-op threads (default: torch's)"
    )
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--skip-tokenizer-init", action="store_true")
    parser.add_argument("--skip-server-warmup", action="store_true")
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "float", "bfloat16", "float16", "half"]
    )
    parser.add_argument("--context-length", type=int, default=None, help="default: max_position_embeddings")
    parser.add_argument(
        "--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1, choices=[1]
    )
    parser.add_argument(
        "--enable-deterministic-inference",
        action="store_true",
        help="honour sampling_seed (SGLang's meaning: without it the seed is ignored)",
    )
    parser.add_argument(
        "--enable-memory-saver",
        action="store_true",
        help="let /release_memory_occupation free the weights and KV (refused without it)",
    )
    parser.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="answer return_routed_experts with each forwarded position's experts (SGLang's meaning)",
    )
    parser.add_argument(
        "--enable-return-indexer-topk",
        action="store_true",
        help="answer return_indexer_topk with each forwarded position's CSA indexer top-k (SGLang's meaning)",
    )
    parser.add_argument(
        "--emulate-non-idempotent-postprocess",
        action="store_true",
        help="the reference engine's own mode, not an SGLang flag: end_weight_update corrupts the routed-"
        "expert and FP8-linear weights the session did not re-send (as SGLang re-shuffles them on ROCm); "
        "a failed update in a session, or such a close, leaves the engine refusing /generate until restarted",
    )
    parser.add_argument(
        "--numerics",
        default="exact",
        choices=["exact", "sglang"],
        help="the reference engine's own mode, not an SGLang flag: `sglang` computes with SGLang 0.5.23's "
        "DeepSeek-V4 rounding points (bf16 activations, FP8 KV cache, FP8 activations of FP8 linears, TF32 "
        "mHC mix, bf16 logits) on the float32 model",
    )
    parser.add_argument(
        "--numerics-features",
        default=None,
        help="with --numerics sglang: only these rounding points, comma-separated (default: every one that "
        "applies to the checkpoint)",
    )
    parser.add_argument(
        "--enable-fp32-lm-head",
        action="store_true",
        help="SGLang's flag: fp32 LM head output (with --numerics sglang the logits are not rounded to bf16)",
    )
    parser.add_argument(
        "--config",
        default=None,
        help="YAML file of flags (keys spelled as the flags, without --), as in SGLang",
    )
    return parser


def merge_config_file(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """SGLang's `--config FILE`: the file's `key: value` pairs become flags placed before the command line's
    (which wins). As in SGLang 0.5.23 (`srt/utils/server_args_config_parser.py`) each key becomes `--<key>`
    verbatim, so keys are the flags' spellings (`admin-api-key`); `true` booleans become bare flags."""
    if "--config" not in argv:
        return argv
    if argv.count("--config") > 1:
        raise SystemExit("Multiple config files specified! Only one allowed.")
    index = argv.index("--config")
    if index == len(argv) - 1:
        raise SystemExit("No config file specified after --config flag!")
    path = Path(argv[index + 1])
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise SystemExit(f"--config {path}: expected a YAML mapping of flag names to values")
    flags: dict[str, argparse.Action] = {
        option[2:]: action
        for action in parser._actions
        for option in action.option_strings
        if option.startswith("--")
    }
    merged: list[str] = []
    for key, value in data.items():
        action = flags.get(str(key))
        if action is None or key == "config":
            dashed = str(key).replace("_", "-")
            hint = f" (flags are spelled with dashes: {dashed!r})" if dashed in flags else ""
            raise SystemExit(f"--config {path}: unknown option {key!r}{hint}")
        if isinstance(action, argparse._StoreTrueAction):
            merged += [f"--{key}"] if value else []
        else:
            merged += [f"--{key}", str(value)]
    return merged + argv[:index] + argv[index + 2 :]


def parse_args(argv: list[str] | None = None) -> dict[str, Any]:
    """Flags as ServerArgs keyword arguments (plus model_path and log_level)."""
    parser = build_parser()
    args = vars(parser.parse_args(merge_config_file(list(sys.argv[1:] if argv is None else argv), parser)))
    args.pop("config")
    args["dtype"] = {"float": "float32", "half": "float16"}.get(args["dtype"], args["dtype"])
    return args
