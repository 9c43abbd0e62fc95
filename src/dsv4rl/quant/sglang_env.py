"""What SGLang 0.5.23's DeepSeek-V4 environment variables do to the weight formats an engine holds.

Read in the released code (sglang `srt/environ.py`, `srt/configs/model_config.py`,
`srt/layers/quantization/fp8.py`, `srt/models/deepseek_v4.py`); pure string logic, so recipe validation
can use it without torch:

- `SGLANG_DSV4_FP4_EXPERTS` (default 1) says whether the checkpoint's routed experts are MXFP4. Setting
  it (to anything) turns off SGLang's detection from the safetensors header, so `0` is for checkpoints
  that already hold FP8 experts; against the released (MXFP4) checkpoint the engine allocates FP8 experts
  and fails to load. It does not convert anything. A checkpoint whose `quantization_config` says
  `routed_experts_quant_method: mxfp4` is MXFP4 whatever the variable says.
- `SGLANG_DSV4_FP4_DEQUANT=1` converts MXFP4 experts to FP8 (128x128 blocks, float32 scales) after
  loading, and turns detection back on. Incompatible with the aiter MegaMoE
  (`SGLANG_AMD_USE_FLYDSL_MEGA_MOE`).
- `SGLANG_OPT_FP8_WO_A_GEMM` (default 1) keeps `wo_a` in FP8 and re-derives its scales after every
  `load_weights` call; online updates of `wo_a` then fail or corrupt it. With `0`, `wo_a` is dequantised
  to BF16 when its weight and scale arrive in the same request.
- MXFP4 expert scales are held as E8M0 when aiter is used (`SGLANG_USE_AITER=1` on ROCm) or the MoE runner
  is flashinfer_mxfp4, else as float32; FP8 expert scales are float32. Which runner an engine gets, and
  whether its updates can be repeated, is `dsv4rl.quant.sglang_moe`'s table.
Booleans parse as SGLang's `EnvBool`: true/1/yes/y and false/0/no/n, case-insensitive.
"""

from __future__ import annotations

from collections.abc import Mapping

from dsv4rl.config.choices import QuantMode
from dsv4rl.config.schema import Config

FP4_EXPERTS = "SGLANG_DSV4_FP4_EXPERTS"
FP4_DEQUANT = "SGLANG_DSV4_FP4_DEQUANT"
FP8_WO_A_GEMM = "SGLANG_OPT_FP8_WO_A_GEMM"
USE_AITER = "SGLANG_USE_AITER"
FLYDSL_MEGA_MOE = "SGLANG_AMD_USE_FLYDSL_MEGA_MOE"

_TRUE = ("true", "1", "yes", "y")
_FALSE = ("false", "0", "no", "n")

# Expert formats an engine can hold.
MXFP4 = "mxfp4"
FP8 = "fp8"
UNQUANTIZED = "unquantized"


def env_flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    """SGLang's boolean parsing; ValueError names the variable when the value is not a boolean."""
    if name not in env:
        return default
    value = str(env[name]).strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={env[name]!r} is not a boolean SGLang accepts (use 1/0, true/false)")


def expert_format(
    env: Mapping[str, str],
    checkpoint_experts: str | None,
    routed_experts_quant_method: str | None = None,
) -> str:
    """The routed-expert format a DeepSeek-V4 SGLang engine holds after start-up.

    `checkpoint_experts` is what the checkpoint stores (MXFP4, FP8, UNQUANTIZED, or None when unknown);
    an unquantized checkpoint has no quantization config, so its experts stay unquantized.
    """
    if checkpoint_experts == UNQUANTIZED:
        return UNQUANTIZED
    if routed_experts_quant_method == MXFP4:
        fp4 = True
    else:
        fp4 = env_flag(env, FP4_EXPERTS, True)
        if (FP4_EXPERTS not in env or env_flag(env, FP4_DEQUANT, False)) and checkpoint_experts is not None:
            fp4 = checkpoint_experts == MXFP4
    if fp4 and env_flag(env, FP4_DEQUANT, False):
        return FP8
    return MXFP4 if fp4 else FP8


def expert_scale_dtype(env: Mapping[str, str], held_experts: str, backend: str | None = None) -> str:
    """The dtype name of the routed-expert scales SGLang holds for `held_experts` under the MoE runner
    `backend` it resolved (None: not known). MXFP4 scales are created E8M0 with aiter
    (`srt/layers/quantization/fp8.py:1697-1699`) and by the flashinfer_mxfp4 CUTLASS method
    (`mxfp4_flashinfer_cutlass_moe.py:76-84`), float32 otherwise; FP8 block scales are float32
    (`fp8.py:1721-1729`)."""
    if held_experts == MXFP4 and (env_flag(env, USE_AITER, False) or backend == "flashinfer_mxfp4"):
        return "float8_e8m0fnu"
    return "float32"


def engine_env(cfg: Config) -> dict[str, str]:
    """comm.env with quant.engine_env over it: what an SGLang engine of this recipe reads."""
    return {
        **{str(k): str(v) for k, v in cfg.comm.env.items()},
        **{str(k): str(v) for k, v in cfg.quant.engine_env.items()},
    }


def env_problems(quant: QuantMode, env: Mapping[str, str]) -> list[str]:
    """Why SGLang engines with `env` would fail or corrupt weights for quant mode `quant`; each names the fix.

    Reads only the recipe (any machine); `checkpoint_problems` adds what the checkpoint itself says.
    """
    problems: list[str] = []
    for name in (FP4_EXPERTS, FP4_DEQUANT, FP8_WO_A_GEMM, USE_AITER, FLYDSL_MEGA_MOE):
        try:
            env_flag(env, name, False)
        except ValueError as error:
            problems.append(str(error))
    if problems or not QuantMode(quant).quantized:
        return problems
    if env_flag(env, FP8_WO_A_GEMM, True):
        problems.append(
            f"quant={quant} with SGLang needs {FP8_WO_A_GEMM}=0: with its default 1, SGLang keeps wo_a in "
            "FP8 and re-derives its scales after every update request, which rejects or corrupts online "
            f"updates; set +quant.engine_env.{FP8_WO_A_GEMM}=0"
        )
    dequant = env_flag(env, FP4_DEQUANT, False)
    fp4_off = not env_flag(env, FP4_EXPERTS, True)
    if dequant and env_flag(env, FLYDSL_MEGA_MOE, False):
        problems.append(
            f"{FP4_DEQUANT}=1 cannot be combined with {FLYDSL_MEGA_MOE}=1 (the aiter MegaMoE); "
            "drop one of them"
        )
    if quant == QuantMode.fp8_mxfp4 and dequant:
        problems.append(
            f"quant=fp8_mxfp4 sends MXFP4 experts, but {FP4_DEQUANT}=1 makes SGLang convert its experts "
            f"to FP8 at load: drop {FP4_DEQUANT} or use quant=fp8_rollout"
        )
    elif quant == QuantMode.fp8_mxfp4 and fp4_off:
        problems.append(
            f"quant=fp8_mxfp4 sends MXFP4 experts, but {FP4_EXPERTS}=0 tells SGLang the checkpoint holds "
            "FP8 experts (it converts nothing; with the released MXFP4 checkpoint it fails at start-up): "
            f"remove it (~quant.engine_env.{FP4_EXPERTS}, or from comm.env)"
        )
    if quant == QuantMode.fp8_rollout and not (dequant or fp4_off):
        problems.append(
            "quant=fp8_rollout sends FP8 experts, but SGLang serves a DeepSeek-V4 checkpoint's experts "
            f"as MXFP4 unless told otherwise: set +quant.engine_env.{FP4_DEQUANT}=1 for the released "
            f"(MXFP4) checkpoint, or +quant.engine_env.{FP4_EXPERTS}=0 for an FP8-converted one"
        )
    return problems


def checkpoint_problems(quant: QuantMode, env: Mapping[str, str], checkpoint_experts: str) -> list[str]:
    """What goes wrong when SGLang with `env` serves a checkpoint whose experts are `checkpoint_experts`
    (MXFP4, FP8 or UNQUANTIZED) and the trainer sends quant mode `quant`."""
    quantized = QuantMode(quant).quantized
    if quantized and checkpoint_experts == UNQUANTIZED:
        return [
            f"quant={quant} sends FP8 weights, but model.path holds an unquantized checkpoint: SGLang "
            "holds its weights unquantized and refuses FP8; use quant=bf16 (or quant=none)"
        ]
    if not quantized and checkpoint_experts in (MXFP4, FP8):
        return [
            f"quant={quant} sends unquantized weights, but model.path holds an FP8 checkpoint (experts "
            f"{checkpoint_experts}): SGLang holds FP8 weights and would refuse ('Downcasting not allowed') "
            "or silently cast them with stale scales; use quant=fp8_mxfp4 for the released checkpoint"
        ]
    if not quantized:
        return []
    try:
        held = expert_format(env, checkpoint_experts)
    except ValueError:
        return []  # env_problems reports the unparsable variable
    if quant == QuantMode.fp8_mxfp4 and checkpoint_experts == FP8:
        return [
            "quant=fp8_mxfp4 sends MXFP4 experts, but model.path holds FP8 experts: use quant=fp8_rollout"
        ]
    if checkpoint_experts == MXFP4 and held == FP8 and not env_flag(env, FP4_DEQUANT, False):
        return [
            f"{FP4_EXPERTS}=0 tells SGLang that model.path holds FP8 experts, but it holds MXFP4 ones: "
            f"SGLang fails at start-up; use +quant.engine_env.{FP4_DEQUANT}=1 to convert them instead"
        ]
    return []
