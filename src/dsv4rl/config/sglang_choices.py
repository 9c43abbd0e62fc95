"""The choices that mirror SGLang's own: its request and server options (`/pause_generation`'s mode,
`load_format`, `--moe-runner-backend`) and how its kernels see a GPU and load the routed experts. They
change with SGLang's release (pinned in `dsv4rl/engine/sglang_contract.json`), not with dsv4rl's recipes;
the recipe keys that take one are in `dsv4rl.config.schema`."""

from __future__ import annotations

from dsv4rl.config.choices import Choice


class PauseMode(Choice):
    """How SGLang's /pause_generation treats in-flight requests while weights change."""

    abort = "abort"
    retract = "retract"  # back to the queue, re-prefilled with the new weights
    in_place = "in_place"  # kept with their (stale) KV cache


class SyncLoadFormat(Choice):
    """How a bucket crosses the wire: SGLang's `load_format` of /update_weights_from_distributed and
    /update_weights_from_tensor."""

    per_tensor = "per_tensor"  # SGLang's null: one broadcast (or handle) per tensor
    flattened_bucket = "flattened_bucket"  # one uint8 buffer per bucket: one collective per request


class DeviceFamily(Choice):
    """What SGLang's kernels see of a `DeviceKind` (`dsv4rl.quant.sglang_moe.DEVICE_FAMILY`): the same
    family runs the same weight post-processing. unknown: cluster.device=cpu (the GPU is not named)."""

    unknown = "unknown"
    hopper = "hopper"  # sm90, CUDA: H100, H200
    cdna3 = "cdna3"  # gfx942, ROCm, FP8 as e4m3fnuz: MI300X, MI325X
    cdna4 = "cdna4"  # gfx950, ROCm, FP8 as e4m3fn: MI355X


class ExpertLoad(Choice):
    """How an SGLang engine gets its routed experts, from `quant` and its environment
    (`dsv4rl.quant.sglang_moe.expert_load`)."""

    unquantized = "unquantized"  # quant none/bf16: an unquantized checkpoint
    fp8 = "fp8"  # FP8 experts as stored (an FP8-expert checkpoint, SGLANG_DSV4_FP4_EXPERTS=0)
    fp4_dequant = "fp4_dequant"  # MXFP4 checkpoint converted to FP8 at load (SGLANG_DSV4_FP4_DEQUANT=1)
    mxfp4 = "mxfp4"  # MXFP4 experts as stored (the released checkpoint, quant=fp8_mxfp4)


class MoeRunnerBackend(Choice):
    """SGLang 0.5.23's `--moe-runner-backend` values dsv4rl passes or names (its full list is
    `sglang/srt/arg_groups/choices.py` MOE_RUNNER_BACKEND_CHOICES, pinned in the contract file)."""

    auto = "auto"
    triton = "triton"
    aiter = "aiter"
    deep_gemm = "deep_gemm"
    flashinfer_mxfp4 = "flashinfer_mxfp4"
    marlin = "marlin"
    humming = "humming"
