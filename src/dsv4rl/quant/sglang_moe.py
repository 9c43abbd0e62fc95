"""Which MoE runner backend SGLang 0.5.23 engines get, what they then hold, and whether updating them can
be repeated: a table read in the released code, keyed by the schema's enums.

Every weight-update session ends with `/end_weight_update`, which runs `process_weights_after_loading` of
every quantized module again, whether or not the session re-sent that module's tensors
(`sglang/srt/model_executor/model_runner_components/weight_updater.py:317-323`,
`sglang/srt/model_loader/loader.py:1079-1089`); `restore_weights_before_loading` at the session's start
undoes nothing for the methods below (`loader.py:1092-1100`: Fp8MoEMethod does not implement it and the
MXFP4 wrappers cannot). So a backend's update path falls in one of three classes:

- **idempotent**: post-processing a module again leaves it as it was. A failed push can be closed and
  pushed again on the same engines.
- **not idempotent, complete pushes right**: post-processing re-lays the weights out in place (aiter's
  shuffles). A module re-sent is laid out once from fresh checkpoint-layout tensors, so every complete push
  is right, but a module that was not re-sent is laid out twice: corrupt. A failed or abandoned push
  therefore ends with fresh engines (`dsv4rl.sync.weight_sync`: the session is left open, the run stops).
- **refused**: post-processing replaces the parameters (new `Parameter`s without `weight_loader`, another
  layout) or the kernels misread what a push sends, so even a complete push fails or corrupts. Validation
  refuses the recipe and names what works.

The key is (how the engine gets its experts, the GPU's family, whether aiter runs): `ExpertLoad` comes from
`quant` and `quant.engine_env` (`expert_load`), the family from `cluster.device` (`DEVICE_FAMILY`), aiter
from `SGLANG_USE_AITER` on ROCm (`sglang/srt/layers/quantization/fp8.py:149`). The planner passes the row's
backend explicitly (`--moe-runner-backend`); `auto` only where SGLang demands it
(`SGLANG_DSV4_FP4_DEQUANT=1` asserts it, `fp8.py:425-429`), and the row says what `auto` resolves to.
The table assumes SGLang's default `--moe-a2a-backend none` (validation keeps it out of `engine.extra_args`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsv4rl.config.choices import DeviceKind, QuantMode, RolloutEngineKind
from dsv4rl.config.schema import Config
from dsv4rl.config.sglang_choices import DeviceFamily, ExpertLoad, MoeRunnerBackend
from dsv4rl.quant.sglang_env import FP4_DEQUANT, FP8, MXFP4, UNQUANTIZED, USE_AITER, engine_env, env_flag

__all__ = [
    "DEVICE_FAMILY",
    "EMULATE_FLAG",
    "MOE_PATHS",
    "MoePath",
    "device_family",
    "emulates_non_idempotent",
    "expert_load",
    "moe_path",
    "moe_problems",
    "moe_refusal",
    "plan_info",
    "recipe_moe_path",
    "restart_reason",
    "uses_aiter",
]

DEVICE_FAMILY: dict[DeviceKind, DeviceFamily] = {
    DeviceKind.cpu: DeviceFamily.unknown,
    DeviceKind.h100: DeviceFamily.hopper,
    DeviceKind.h200: DeviceFamily.hopper,
    DeviceKind.mi300x: DeviceFamily.cdna3,
    DeviceKind.mi325x: DeviceFamily.cdna3,
    DeviceKind.mi355x: DeviceFamily.cdna4,
}
ROCM = (DeviceFamily.cdna3, DeviceFamily.cdna4)
E8M0 = "float8_e8m0fnu"
F32 = "float32"
Q = "sglang/srt/layers/quantization/"
EMULATE_FLAG = "--emulate-non-idempotent-postprocess"  # the reference engine's flag (dsv4rl.engine.args)
FP8_FIX = "use quant=fp8_rollout with +quant.engine_env.SGLANG_DSV4_FP4_DEQUANT=1 (experts FP8 from load on)"


@dataclass(frozen=True)
class MoePath:
    """One row: what the planner passes, what SGLang then runs and holds, and whether updates repeat."""

    backend: MoeRunnerBackend  # --moe-runner-backend as passed
    resolves_to: MoeRunnerBackend | None  # what SGLang runs (None: depends on the GPU)
    experts: str  # the routed experts SGLang holds (sglang_env.MXFP4 / FP8 / UNQUANTIZED)
    expert_scale_dtype: str | None  # the dtype of their scales (None: unquantized)
    idempotent: bool | None  # post-processing again changes nothing (None: not known)
    updatable: bool  # a complete push loads and is served right
    source: str  # where the released code says so (sglang/srt/...:line)
    note: str  # why, in a sentence
    fix: str = ""  # for a refused row: what works

    @property
    def linear_scale_dtype(self) -> str | None:
        """FP8 linears keep float32 block scales (`fp8.py:674-680`); none without an FP8 checkpoint."""
        return None if self.experts == UNQUANTIZED else F32


def _refused_gfx942(backend: MoeRunnerBackend, experts: str, scale: str | None) -> MoePath:
    return MoePath(
        backend, None, experts, scale, False, False,
        f"{Q}fp8.py:817-836,2138-2160, {Q}fp8_utils.py:414",
        "on gfx942 every FP8 linear is normalized to e4m3fnuz at load and the normalization asserts e4m3fn "
        "at every later post-processing; FP8 expert weights become new Parameters without weight_loader: "
        "an FP8 update fails",
        "use quant=bf16 on MI300X/MI325X",
    )  # fmt: skip


_UNQUANTIZED = MoePath(
    MoeRunnerBackend.triton, MoeRunnerBackend.triton, UNQUANTIZED, None, True, True,
    f"{Q}unquant.py:852-868",
    "UnquantizedFusedMoEMethod shuffles expert weights for aiter only under the auto or aiter runner; under "
    "triton its post-processing leaves them as loaded",
)  # fmt: skip
_MXFP4_HOPPER = MoePath(
    MoeRunnerBackend.auto, MoeRunnerBackend.flashinfer_mxfp4, MXFP4, E8M0, False, False,
    "sglang/srt/arg_groups/model_overrides/deepseek_v4.py:66-88, "
    f"{Q}mxfp4_flashinfer_cutlass_moe.py:76-84,220-223, sglang/srt/models/deepseek_v4.py:5451, "
    f"{Q}marlin_utils_fp4.py:448-465, {Q}mxfp4_humming_moe.py:82-97, {Q}fp8.py:3018-3037",
    "auto becomes flashinfer_mxfp4, whose post-processing replaces the expert weights and E8M0 scales by "
    "interleaved Parameters without weight_loader: the first bucket holding a routed expert fails with the "
    "model partly updated; marlin and humming replace or delete them too, and triton reads packed MXFP4 "
    "as FP8",
    FP8_FIX,
)  # fmt: skip
_MXFP4_AITER = MoePath(
    MoeRunnerBackend.auto, MoeRunnerBackend.aiter, MXFP4, E8M0, False, False,
    f"{Q}fp8.py:1902-2027,1697-1699",
    "aiter's MXFP4 arm pads, re-views as FP4 and shuffles expert weights and scales in place at every "
    "post-processing, and nothing restores that layout before a load",
    FP8_FIX,
)  # fmt: skip
_MXFP4_TRITON = MoePath(
    MoeRunnerBackend.triton, MoeRunnerBackend.triton, MXFP4, F32, True, False,
    f"{Q}fp8.py:3018-3037",
    "the triton runner has no MXFP4 path: it reads the packed FP4 experts as FP8 blocks",
    FP8_FIX,
)  # fmt: skip

# (how the experts load, family, aiter: None for either) -> the path; the first matching row wins.
MOE_PATHS: list[tuple[ExpertLoad, DeviceFamily | None, bool | None, MoePath]] = [
    (ExpertLoad.unquantized, None, None, _UNQUANTIZED),
    # FP8 experts as stored: the backend is free, triton re-lays nothing out.
    (ExpertLoad.fp8, DeviceFamily.hopper, None, MoePath(
        MoeRunnerBackend.triton, MoeRunnerBackend.triton, FP8, F32, True, True,
        f"{Q}fp8.py:2275-2288, {Q}fp8_utils.py:2166-2177",
        "block-FP8 experts and linears: the UE8M0 re-quantization is for the DeepGEMM runner on sm100/sm120 "
        "only; nothing else is re-laid out",
    )),
    (ExpertLoad.fp8, DeviceFamily.cdna3, None, _refused_gfx942(MoeRunnerBackend.triton, FP8, F32)),
    (ExpertLoad.fp8, DeviceFamily.cdna4, True, MoePath(
        MoeRunnerBackend.triton, MoeRunnerBackend.triton, FP8, F32, False, True,
        f"{Q}fp8.py:915-929, {Q}fp8_utils.py:83",
        "the experts stay as loaded under triton, but aiter on gfx950 (HIP >= 7.2) pre-shuffles every FP8 "
        "linear weight in place at every post-processing",
    )),
    (ExpertLoad.fp8, DeviceFamily.cdna4, False, MoePath(
        MoeRunnerBackend.triton, MoeRunnerBackend.triton, FP8, F32, True, True,
        f"{Q}fp8.py:2161-2174",
        "without aiter nothing is shuffled; gfx950 holds FP8 as e4m3fn, as sent",
    )),
    (ExpertLoad.fp8, DeviceFamily.unknown, None, MoePath(
        MoeRunnerBackend.triton, None, FP8, F32, None, True, "(the GPU decides)",
        "idempotent on hopper and on cdna4 without aiter, not with aiter, refused on cdna3",
    )),
    # MXFP4 checkpoint, FP8 experts from load on: SGLang asserts auto.
    (ExpertLoad.fp4_dequant, DeviceFamily.hopper, None, MoePath(
        MoeRunnerBackend.auto, MoeRunnerBackend.triton, FP8, F32, True, True,
        f"{Q}fp8.py:425-429,2962-2972,2196-2213, sglang/srt/arg_groups/model_overrides/deepseek_v4.py:78",
        "auto stays off flashinfer_mxfp4 and resolves to triton; the experts are de-quantized once "
        "(is_fp4_expert turns false) and kept in their Parameters, weight_loader included",
    )),
    (ExpertLoad.fp4_dequant, DeviceFamily.cdna3, None, _refused_gfx942(MoeRunnerBackend.auto, FP8, F32)),
    (ExpertLoad.fp4_dequant, DeviceFamily.cdna4, True, MoePath(
        MoeRunnerBackend.auto, MoeRunnerBackend.aiter, FP8, F32, False, True,
        f"{Q}fp8.py:425-429,2966-2970,1858-1875,2163-2174,915-929",
        "auto resolves to aiter; the experts are de-quantized once, then their weights are re-shuffled in "
        "place at every post-processing (and aiter pre-shuffles the FP8 linears too)",
    )),
    (ExpertLoad.fp4_dequant, DeviceFamily.cdna4, False, MoePath(
        MoeRunnerBackend.auto, MoeRunnerBackend.triton, FP8, F32, True, True,
        f"{Q}fp8.py:425-429,2962-2972,2196-2213",
        "without aiter auto resolves to triton; the experts are de-quantized once and nothing is shuffled",
    )),
    (ExpertLoad.fp4_dequant, DeviceFamily.unknown, None, MoePath(
        MoeRunnerBackend.auto, None, FP8, F32, None, True, f"{Q}fp8.py:425-429 (then the GPU decides)",
        "idempotent on hopper and on cdna4 without aiter, not with aiter, refused on cdna3",
    )),
    # MXFP4 experts as stored (quant=fp8_mxfp4): no backend updates them in place.
    (ExpertLoad.mxfp4, DeviceFamily.hopper, None, _MXFP4_HOPPER),
    (ExpertLoad.mxfp4, DeviceFamily.cdna3, None, _refused_gfx942(MoeRunnerBackend.auto, MXFP4, None)),
    (ExpertLoad.mxfp4, DeviceFamily.cdna4, True, _MXFP4_AITER),
    (ExpertLoad.mxfp4, DeviceFamily.cdna4, False, _MXFP4_TRITON),
    (ExpertLoad.mxfp4, DeviceFamily.unknown, None, MoePath(
        MoeRunnerBackend.auto, None, MXFP4, None, False, False, _MXFP4_HOPPER.source,
        "refused on every family: " + _MXFP4_HOPPER.note, FP8_FIX,
    )),
]  # fmt: skip


def device_family(device: DeviceKind) -> DeviceFamily:
    return DEVICE_FAMILY[DeviceKind(device)]


def uses_aiter(family: DeviceFamily, env: dict[str, str]) -> bool:
    """SGLang runs aiter only on ROCm with SGLANG_USE_AITER set (`fp8.py:149`); an unparsable value is
    `sglang_env.env_problems`' to report."""
    try:
        return family in ROCM and env_flag(env, USE_AITER, False)
    except ValueError:
        return False


def expert_load(quant: QuantMode, env: dict[str, str]) -> ExpertLoad:
    """How an SGLang engine of this recipe gets its experts (`sglang_env.env_problems` refuses the
    combinations where this is not what the trainer sends)."""
    quant = QuantMode(quant)
    if not quant.quantized:
        return ExpertLoad.unquantized
    try:
        dequant = env_flag(env, FP4_DEQUANT, False)
    except ValueError:
        dequant = False
    if dequant:
        return ExpertLoad.fp4_dequant
    return ExpertLoad.mxfp4 if quant == QuantMode.fp8_mxfp4 else ExpertLoad.fp8


def moe_path(load: ExpertLoad, family: DeviceFamily, aiter: bool = False) -> MoePath:
    for row_load, row_family, row_aiter, path in MOE_PATHS:
        if row_load == load and row_family in (None, family) and row_aiter in (None, aiter):
            return path
    raise KeyError(f"no MoE path for {load}, {family}, aiter={aiter}")  # the table covers every key


def recipe_moe_path(cfg: Config) -> MoePath:
    """The row of this recipe's SGLang engines (the engine kind aside: see `restart_reason`)."""
    env = engine_env(cfg)
    family = device_family(cfg.cluster.device)
    return moe_path(expert_load(cfg.quant.name, env), family, uses_aiter(family, env))


def moe_refusal(cfg: Config) -> str | None:
    """Why SGLang engines of this recipe could not take weight updates at all, naming what works; None
    when a complete push works."""
    path = recipe_moe_path(cfg)
    if path.updatable:
        return None
    family = device_family(cfg.cluster.device)
    where = "on every GPU family" if family == DeviceFamily.unknown else f"on {cfg.cluster.device.value}"
    return (
        f"quant={cfg.quant.name.value} with SGLang {where}: {path.note} ({path.source}), so weight updates "
        f"fail or corrupt the engines; {path.fix}"
    )


def moe_problems(cfg: Config) -> list[str]:
    """`moe_refusal` for recipes that run SGLang engines (validation)."""
    if cfg.parallel.rollout.engine != RolloutEngineKind.sglang:
        return []
    refusal = moe_refusal(cfg)
    return [refusal] if refusal else []


def restart_reason(cfg: Config) -> str | None:
    """Why a failed push must end with fresh engines (their post-processing is not idempotent), or None.

    SGLang: unless the row is known idempotent. The reference engine: when it emulates a non-idempotent
    SGLang path (`emulates_non_idempotent`)."""
    path = recipe_moe_path(cfg)
    if cfg.parallel.rollout.engine == RolloutEngineKind.reference:
        if not emulates_non_idempotent(cfg):
            return None
        if path.idempotent is False:
            return f"the reference engine emulates SGLang's non-idempotent post-processing ({path.note})"
        return (
            f"the reference engine emulates SGLang's non-idempotent post-processing (engine.extra_args has "
            f"{EMULATE_FLAG})"
        )
    if path.idempotent:
        return None
    if path.idempotent is None:
        return (
            f"cluster.device={cfg.cluster.device.value} does not name the GPU, so SGLang's post-processing "
            "is not known to be idempotent"
        )
    return f"SGLang's post-processing on {cfg.cluster.device.value} is not idempotent: {path.note}"


def emulates_non_idempotent(cfg: Config) -> bool:
    """Reference engines rehearse a recipe whose SGLang path is known not idempotent, or were asked to
    (`engine.extra_args` with `--emulate-non-idempotent-postprocess`, the reference engine's own flag: a CPU
    run of a failed push on such engines)."""
    if cfg.parallel.rollout.engine != RolloutEngineKind.reference:
        return False
    asked = EMULATE_FLAG in (str(arg) for arg in cfg.engine.extra_args)
    return asked or recipe_moe_path(cfg).idempotent is False


def plan_info(cfg: Config) -> dict[str, Any]:
    """What `dsv4rl plan` shows of an SGLang engine's MoE path and held scales."""
    path = recipe_moe_path(cfg)
    env = engine_env(cfg)
    family = device_family(cfg.cluster.device)
    return {
        "device_family": family.value,
        "aiter": uses_aiter(family, env),
        "expert_load": expert_load(cfg.quant.name, env).value,
        "moe_runner_backend": path.backend.value,
        "resolves_to": path.resolves_to.value if path.resolves_to is not None else None,
        "experts": path.experts,
        "expert_scale_dtype": path.expert_scale_dtype,
        "linear_scale_dtype": path.linear_scale_dtype,
        "idempotent": path.idempotent,
        "updatable": path.updatable,
        "restart_on_failed_push": restart_reason(cfg) is not None,
        "source": path.source,
        "note": path.note,
    }
