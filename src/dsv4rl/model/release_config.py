"""The release's config.json keys, written beside transformers' and checked against them.

transformers' `DeepseekV4Config` states a model's layers as `layer_types`, `compress_rates`,
`mlp_layer_types` and a nested `rope_parameters`; the released DeepSeek-V4-Flash config.json
(https://huggingface.co/deepseek-ai/DeepSeek-V4-Flash/blob/main/config.json) states the same model as
`compress_ratios` (one per layer: 0 sliding, 4 CSA, 128 HCA), `num_hash_layers`, `sliding_window`,
`rope_scaling` (YaRN for the compressed layers), `torch_dtype` and `topk_method`. SGLang 0.5.23 reads only
the release's: it re-reads config.json as a `DeepseekV3Config` subclass (`sglang/srt/utils/hf_transformers/
common.py:204`, `config.py:293`), so transformers' V4 keys are inert attributes there, and

- `compress_ratios[layer]` builds each attention (`sglang/srt/models/deepseek_v4.py:1044`; missing, it
  fails at construction) and the ratio alone says which kind: 4 gets an overlapping compressor and an
  indexer, 128 a plain compressor (`deepseek_v4.py:1451-1469`, `layers/attention/dsv4/compressor.py:59`);
- `num_hash_layers` makes the first layers hash-routed (`sglang/srt/models/deepseek_v2.py:711`; missing,
  it is 0 and every layer is routed by score, silently);
- `topk_method: noaux_tc` gives the score-routed gates their correction bias (`deepseek_v2.py:519`;
  missing, the V3 config has no such attribute and construction fails);
- `rope_scaling` is the compressed layers' RoPE (`deepseek_v4.py:1171-1197`; without
  `original_max_position_embeddings` it fails there), and `rope_theta`, `compress_rope_theta`,
  `qk_rope_head_dim` are read as they are, not from `rope_parameters`;
- `torch_dtype` is the checkpoint's dtype for `--dtype auto` (`sglang/srt/configs/model_config.py:2284`);
  transformers writes `dtype: null`, which SGLang takes for float32 and serves as float16;
- the attention window is the constant 128 (`SWA_WINDOW`, `sglang/srt/layers/attention/
  deepseek_v4_backend.py:161`); `sliding_window` (a key both configs share) only sizes its KV pool
  (`model_config.py:1425`).

transformers reads the release's keys only where its own are absent (`compress_ratios` and
`num_hash_layers` are folded in by `DeepseekV4Config.__post_init__`), except `rope_scaling`, which wins over
`rope_parameters` (`modeling_rope_utils.py`, `convert_rope_params_to_dict`): `dsv4rl`'s loader drops it when
`rope_parameters` is there. Every config.json dsv4rl writes carries both key sets from the same settings
(`with_release_keys`); `release_key_problems` names any disagreement, and `sglang_problems` what SGLang
would build differently from transformers. Standard library only: the launcher checks without torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dsv4rl.config.model_schema import LAYER_TYPES, TinyModelConfig

__all__ = [
    "RELEASE_KEYS",
    "SGLANG_SLIDING_WINDOW",
    "LayerSchedule",
    "ReleaseConfigError",
    "check_release_keys",
    "model_type_problem",
    "release_key_problems",
    "release_keys",
    "release_rope_scaling",
    "sglang_problems",
    "sglang_schedule",
    "tiny_transformers_keys",
    "transformers_keys_for_loading",
    "transformers_schedule",
    "with_release_keys",
]

SLIDING, CSA, HCA = LAYER_TYPES
HASH_MOE, MOE = "hash_moe", "moe"
RELEASE_KEYS = (
    "compress_ratios",
    "num_hash_layers",
    "sliding_window",
    "rope_scaling",
    "torch_dtype",
    "topk_method",
)
# The kind the release's readers take each ratio for (SGLang; transformers' `_COMPRESS_RATIO_TO_LAYER_TYPE`).
RATIO_KINDS = {0: SLIDING, 4: CSA, 128: HCA}
SGLANG_SLIDING_WINDOW = 128  # sglang/srt/layers/attention/deepseek_v4_backend.py:161
TOPK_METHOD = "noaux_tc"  # every DeepSeek-V4 score-routed gate has its correction bias
# transformers' DeepseekV4Config defaults, for configs that leave a key out
DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}
DEFAULT_NUM_HASH_LAYERS = 3
DEFAULT_SLIDING_WINDOW = 128
YARN_BETA_FAST, YARN_BETA_SLOW = 32, 1  # transformers' and SGLang's defaults (deepseek_v4.py:1195)
REWRITE = "rewrite it from one set of settings (dsv4rl writes both; for the tiny model delete the directory)"


class ReleaseConfigError(ValueError):
    """A config.json whose release keys cannot state, or do not state, the model transformers' keys do."""


@dataclass(frozen=True)
class LayerSchedule:
    """Per layer: the attention kind, its compress ratio (0 for sliding), whether it is hash-routed; and the
    sliding window."""

    attention: tuple[str, ...]
    compress_ratios: tuple[int, ...]
    hash_routed: tuple[bool, ...]
    sliding_window: int

    def differences(self, other: LayerSchedule) -> list[str]:
        """What `other` builds differently, one line per kind of difference ("self vs other")."""
        out = []
        if len(self.attention) != len(other.attention):
            return [f"{len(self.attention)} layers vs {len(other.attention)}"]
        for layer, (kind, ratio, other_kind, other_ratio) in enumerate(
            zip(self.attention, self.compress_ratios, other.attention, other.compress_ratios, strict=True)
        ):
            if (kind, ratio) != (other_kind, other_ratio):
                out.append(f"layer {layer}: {kind} (ratio {ratio}) vs {other_kind} (ratio {other_ratio})")
        if self.hash_routed != other.hash_routed:
            out.append(f"hash-routed layers {_hashed(self)} vs {_hashed(other)}")
        if self.sliding_window != other.sliding_window:
            out.append(f"sliding window {self.sliding_window} vs {other.sliding_window}")
        return out


def _hashed(schedule: LayerSchedule) -> list[int]:
    return [layer for layer, hashed in enumerate(schedule.hash_routed) if hashed]


# ------------------------------------------------------------------------------------------- reading
def transformers_schedule(config: Mapping[str, Any]) -> LayerSchedule:
    """The layers transformers' DeepseekV4Config builds from `config` (its own keys, else the release's)."""
    n = int(config["num_hidden_layers"])
    layer_types = config.get("layer_types")
    if layer_types is None:
        ratios = config.get("compress_ratios")
        if ratios is None:
            raise ReleaseConfigError(
                "config.json has neither transformers' layer_types nor the release's compress_ratios"
            )
        unknown = sorted({r for r in ratios[:n] if r not in RATIO_KINDS})
        if unknown:
            raise ReleaseConfigError(
                f"compress_ratios has {unknown}: a DeepSeek-V4 layer's ratio is 0, 4 or 128"
            )
        layer_types = [RATIO_KINDS[r] for r in ratios]
    layer_types = list(layer_types)[:n]
    rates = {**DEFAULT_COMPRESS_RATES, **(config.get("compress_rates") or {})}
    mlp = config.get("mlp_layer_types")
    if mlp is None:
        hashed = config.get("num_hash_layers")
        hashed = DEFAULT_NUM_HASH_LAYERS if hashed is None else int(hashed)
        mlp = [HASH_MOE] * min(n, hashed) + [MOE] * max(0, n - hashed)
    return LayerSchedule(
        attention=tuple(layer_types),
        compress_ratios=tuple(0 if kind == SLIDING else int(rates[kind]) for kind in layer_types),
        hash_routed=tuple(kind == HASH_MOE for kind in list(mlp)[:n]),
        sliding_window=int(config.get("sliding_window") or DEFAULT_SLIDING_WINDOW),
    )


def sglang_schedule(config: Mapping[str, Any]) -> LayerSchedule:
    """The layers SGLang 0.5.23 builds from `config`: the release's keys only (see the module docstring)."""
    n = int(config["num_hidden_layers"])
    ratios = config.get("compress_ratios")
    if ratios is None or len(ratios) < n:
        raise ReleaseConfigError(
            f"compress_ratios {'is missing' if ratios is None else f'lists {len(ratios)} layers of {n}'}: "
            "SGLang 0.5.23 builds each attention from compress_ratios[layer] and fails at construction "
            "(sglang/srt/models/deepseek_v4.py:1044)"
        )
    hashed = int(config.get("num_hash_layers") or 0)
    return LayerSchedule(
        attention=tuple(RATIO_KINDS.get(int(r), f"ratio {r}") for r in ratios[:n]),
        compress_ratios=tuple(int(r) for r in ratios[:n]),
        hash_routed=tuple(layer < hashed for layer in range(n)),
        sliding_window=SGLANG_SLIDING_WINDOW,
    )


# ------------------------------------------------------------------------------------------- deriving
def _rope(config: Mapping[str, Any], label: str) -> dict[str, Any] | None:
    """transformers' nested `rope_parameters[label]` ("main": sliding layers, "compress": CSA/HCA)."""
    nested = config.get("rope_parameters")
    if isinstance(nested, Mapping) and isinstance(nested.get(label), Mapping):
        return dict(nested[label])
    return None


def _rope_type(parameters: Mapping[str, Any]) -> str:
    return str(parameters.get("rope_type", parameters.get("type", "default")))


def release_rope_scaling(config: Mapping[str, Any]) -> dict[str, Any]:
    """The release's `rope_scaling` for transformers' compressed-layer RoPE: its YaRN keys, or YaRN with
    factor 1 (what SGLang computes as unscaled RoPE, `sglang/kernels/ops/attention/dsv4/rope.py`,
    `precompute_freqs_cis`) when that RoPE is plain; SGLang applies it to every compressed layer."""
    main, compress = _rope(config, "main") or {}, _rope(config, "compress") or {}
    if _rope_type(main) != "default":
        raise ReleaseConfigError(
            f"rope_parameters.main is {_rope_type(main)}: the release's keys give the sliding layers plain "
            "RoPE only (rope_scaling applies to the compressed layers)"
        )
    if _rope_type(compress) == "default":
        factor, original = 1, int(config["max_position_embeddings"])
    elif _rope_type(compress) == "yarn":
        if compress.get("attention_factor") not in (None, 1, 1.0):
            raise ReleaseConfigError(
                f"rope_parameters.compress.attention_factor={compress['attention_factor']}: the release's "
                "YaRN has none (SGLang scales no attention)"
            )
        factor, original = compress["factor"], int(compress["original_max_position_embeddings"])
    else:
        raise ReleaseConfigError(
            f"rope_parameters.compress is {_rope_type(compress)}: the release's rope_scaling is YaRN only"
        )
    return {
        "beta_fast": compress.get("beta_fast", YARN_BETA_FAST),
        "beta_slow": compress.get("beta_slow", YARN_BETA_SLOW),
        "factor": factor,
        "original_max_position_embeddings": original,
        "type": "yarn",
    }


def release_keys(config: Mapping[str, Any], torch_dtype: str | None = None) -> dict[str, Any]:
    """The release's keys for a transformers DeepseekV4Config (`config.to_dict()`), from the same settings.

    `torch_dtype`: the checkpoint's dtype ("float32", "bfloat16"); default: the config's own `dtype`.
    Raises ReleaseConfigError for a model the release's keys cannot state (hash-routed layers after a
    score-routed one, scaled RoPE on the sliding layers).
    """
    schedule = transformers_schedule(config)
    hashed = sum(schedule.hash_routed)
    if schedule.hash_routed != tuple(layer < hashed for layer in range(len(schedule.hash_routed))):
        raise ReleaseConfigError(
            f"mlp_layer_types routes layers {_hashed(schedule)} by hash: the release's num_hash_layers "
            "routes the first N layers by hash, so hash_moe layers must come first"
        )
    keys: dict[str, Any] = {
        "compress_ratios": list(schedule.compress_ratios),
        "num_hash_layers": hashed,
        "sliding_window": schedule.sliding_window,
        "rope_scaling": release_rope_scaling(config),
        "topk_method": TOPK_METHOD,
    }
    dtype = torch_dtype or config.get("dtype") or config.get("torch_dtype")
    if dtype is not None:
        keys["torch_dtype"] = str(dtype).removeprefix("torch.")
    return keys


def with_release_keys(config: Mapping[str, Any], torch_dtype: str | None = None) -> dict[str, Any]:
    """`config` (transformers' keys) plus the release's, checked to agree; transformers' `dtype` is set to the
    checkpoint's dtype too (it is null after a model is built in code)."""
    out = {**config, **release_keys(config, torch_dtype)}
    if "torch_dtype" in out:
        out["dtype"] = out["torch_dtype"]
    check_release_keys(out, "the config.json being written")
    return out


def tiny_transformers_keys(tiny: TinyModelConfig) -> dict[str, Any]:
    """The schedule keys of the tiny model's transformers config (`dsv4rl.model.tiny.tiny_hf_config`),
    without building it (the recipe checks run before torch is imported)."""
    return {
        "num_hidden_layers": tiny.num_hidden_layers,
        "layer_types": list(tiny.layer_types),
        "mlp_layer_types": list(tiny.mlp_layer_types),
        "compress_rates": {CSA: tiny.csa_compress_rate, HCA: tiny.hca_compress_rate},
        "sliding_window": tiny.sliding_window,
        "max_position_embeddings": tiny.max_position_embeddings,
    }


# ------------------------------------------------------------------------------------------- checking
def _number_differs(a: Any, b: Any) -> bool:
    try:
        return float(a) != float(b)
    except (TypeError, ValueError):
        return a != b


# What a DeepSeek-V4 config.json states (transformers' and the release's), and what DeepSeek-V4.1's do: SGLang
# 0.5.23 reads V4.1 as model_type deepseek_v41 (or deepseek_v41_text inside `text_config`), its
# architectures DeepseekV41ForCausalLM (srt/configs/deepseek_v41.py).
V4_MODEL_TYPE = "deepseek_v4"
V41_MODEL_TYPES = ("deepseek_v41", "deepseek_v41_text")
V41_ARCHITECTURE = "DeepseekV41ForCausalLM"


def model_type_problem(config: Mapping[str, Any]) -> str | None:
    """Why dsv4rl cannot train the model `config` (a config.json) describes, naming the fix; None for
    DeepSeek-V4, or a config that states no model_type."""
    model_type = config.get("model_type")
    text = config.get("text_config")
    inner = text.get("model_type") if isinstance(text, Mapping) else None
    if V41_ARCHITECTURE in (config.get("architectures") or []) or {model_type, inner} & set(V41_MODEL_TYPES):
        return (
            f"it holds DeepSeek-V4.1 (model_type {model_type!r}), which dsv4rl's trainer backends do not "
            "build: V4.1 is another architecture (compress ratios 1 and 2 with shared compressors and "
            "indexers, a candidate pool, mHC's lagged pre, Engram tables, its own FP8 blocks; "
            "docs/deepseek_v41.md), so its weights would not load into DeepSeek-V4's modules; point "
            "model.path at a DeepSeek-V4 checkpoint"
        )
    if model_type is not None and model_type != V4_MODEL_TYPE:
        return (
            f"its model_type is {model_type!r}, not {V4_MODEL_TYPE!r}: dsv4rl trains DeepSeek-V4 models "
            "only; point model.path at a DeepSeek-V4 checkpoint"
        )
    return None


def release_key_problems(config: Mapping[str, Any]) -> list[str]:
    """Where the release's keys present in `config` state another model than transformers' keys (one line
    each, naming the key and the fix); [] when they agree or one of the two sets is absent."""
    if config.get("layer_types") is None:
        return []  # a release config: transformers reads the release's keys itself
    try:
        ours = transformers_schedule(config)
    except (KeyError, TypeError, ValueError) as error:
        return [f"transformers' layer keys cannot be read: {error}"]
    n, problems = len(ours.attention), []
    ratios = config.get("compress_ratios")
    if ratios is not None:
        if len(ratios) < n:
            problems.append(
                f"compress_ratios lists {len(ratios)} layers but num_hidden_layers={n}: {REWRITE}"
            )
        pairs = zip(ours.attention, ours.compress_ratios, ratios[:n], strict=False)  # ratios may be short
        for layer, (kind, expected, ratio) in enumerate(pairs):
            if _number_differs(ratio, expected):
                rate = "sliding" if kind == SLIDING else f"compress_rates.{kind}={expected}"
                problems.append(
                    f"compress_ratios[{layer}]={ratio} but layer_types[{layer}]={kind} ({rate}): SGLang "
                    f"builds that layer from compress_ratios, transformers from layer_types; {REWRITE}"
                )
    hashed = config.get("num_hash_layers")
    if hashed is not None:
        stated = tuple(layer < int(hashed) for layer in range(n))
        if stated != ours.hash_routed:
            problems.append(
                f"num_hash_layers={hashed} routes layers {list(range(min(int(hashed), n)))} by hash but "
                f"mlp_layer_types routes {_hashed(ours)}: SGLang reads the first, transformers the second; "
                f"{REWRITE}"
            )
    problems += _rope_problems(config)
    dtype, torch_dtype = config.get("dtype"), config.get("torch_dtype")
    if dtype is not None and torch_dtype is not None and str(dtype) != str(torch_dtype):
        problems.append(
            f"dtype={dtype} but torch_dtype={torch_dtype}: transformers reads dtype, SGLang torch_dtype; "
            f"{REWRITE}"
        )
    method = config.get("topk_method")
    if method is not None and method != TOPK_METHOD:
        problems.append(
            f"topk_method={method!r}: DeepSeek-V4's score-routed gates have a correction bias, which SGLang "
            f"builds only for topk_method={TOPK_METHOD!r} (sglang/srt/models/deepseek_v2.py:519); {REWRITE}"
        )
    return problems


def _rope_problems(config: Mapping[str, Any]) -> list[str]:
    """The keys SGLang reads instead of transformers' `rope_parameters` (and `partial_rotary_factor`)."""
    problems = []
    main, compress = _rope(config, "main"), _rope(config, "compress")
    for key, parameters, label in (
        ("rope_theta", main, "main"),
        ("compress_rope_theta", compress, "compress"),
    ):
        if (
            parameters is not None
            and key in config
            and _number_differs(config[key], parameters.get("rope_theta"))
        ):
            problems.append(
                f"{key}={config[key]} but rope_parameters.{label}.rope_theta={parameters.get('rope_theta')}: "
                f"SGLang reads the first, transformers the second; {REWRITE}"
            )
    factor, head_dim, rope_dim = (
        config.get(k) for k in ("partial_rotary_factor", "head_dim", "qk_rope_head_dim")
    )
    if None not in (factor, head_dim, rope_dim) and int(head_dim * factor) != int(rope_dim):
        problems.append(
            f"qk_rope_head_dim={rope_dim} but head_dim*partial_rotary_factor={int(head_dim * factor)}: "
            f"SGLang reads the first, transformers the second; {REWRITE}"
        )
    scaling = config.get("rope_scaling")
    if compress is None or scaling is None:
        return problems
    try:
        expected = release_rope_scaling(config)
    except ReleaseConfigError as error:
        return [*problems, f"rope_scaling is set but {error}"]
    if _rope_type(scaling) != "yarn":
        problems.append(f"rope_scaling is {_rope_type(scaling)}, not yarn: {REWRITE}")
    for key in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"):
        if _number_differs(
            scaling.get(key, expected[key] if key.startswith("beta") else None), expected[key]
        ):
            problems.append(
                f"rope_scaling.{key}={scaling.get(key)} but transformers' compressed-layer RoPE "
                f"(rope_parameters.compress) means {expected[key]}: {REWRITE}"
            )
    return problems


def check_release_keys(config: Mapping[str, Any], source: str) -> None:
    """ReleaseConfigError naming every disagreement between the two key sets of `config` (from `source`)."""
    problems = release_key_problems(config)
    if problems:
        raise ReleaseConfigError(
            f"{source}: the release's keys (read by SGLang) and transformers' keys (read by the trainer and "
            "the reference engine) state different models:\n  - " + "\n  - ".join(problems)
        )


def sglang_problems(config: Mapping[str, Any]) -> list[str]:
    """What SGLang 0.5.23 would build from `config` differently from transformers, or fail on (one line
    each); [] when it builds the same layers."""
    try:
        served = sglang_schedule(config)
        ours = transformers_schedule(config)
    except (KeyError, TypeError, ValueError) as error:
        return [str(error)]
    problems = []
    for difference in ours.differences(served):
        if difference.startswith("layer "):
            problems.append(
                f"{difference} (transformers vs SGLang): SGLang tells the kind by the ratio alone, 4 being "
                "CSA (an overlapping compressor and an indexer) and 128 HCA "
                "(sglang/srt/models/deepseek_v4.py:1451-1469): it serves CSA at ratio 4 and HCA at 128 only"
            )
        elif difference.startswith("hash"):
            problems.append(
                f"{difference} (transformers vs SGLang): SGLang routes the first num_hash_layers layers by "
                "hash (sglang/srt/models/deepseek_v2.py:711; 0 when the key is missing)"
            )
        else:
            problems.append(
                f"{difference} (transformers vs SGLang): SGLang's DeepSeek-V4 attention window is the "
                f"constant {SGLANG_SLIDING_WINDOW} (sglang/srt/layers/attention/deepseek_v4_backend.py:161)"
            )
    if any(served.compress_ratios) and "original_max_position_embeddings" not in (
        config.get("rope_scaling") or {}
    ):
        problems.append(
            "rope_scaling (with original_max_position_embeddings) is missing: SGLang builds the compressed "
            "layers' RoPE from it and fails at construction (sglang/srt/models/deepseek_v4.py:1185)"
        )
    if config.get("topk_method") != TOPK_METHOD:
        problems.append(
            f"topk_method is {config.get('topk_method')!r}, not {TOPK_METHOD!r}: SGLang's gate reads it "
            "(sglang/srt/models/deepseek_v2.py:519; missing, construction fails)"
        )
    return problems


def transformers_keys_for_loading(config: Mapping[str, Any]) -> dict[str, Any]:
    """`config` as dsv4rl hands it to transformers: the release's `rope_scaling` left out when transformers'
    own `rope_parameters` is there (transformers would let it win; the two were checked to agree)."""
    out = dict(config)
    if _rope(out, "main") is not None and _rope(out, "compress") is not None:
        out.pop("rope_scaling", None)
    return out
