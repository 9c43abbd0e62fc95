#!/usr/bin/env bash
# The GPU check: what dsv4rl does only on GPUs, reported as one JSON summary to paste into an issue; exits 1
# when a check that ran failed. The checks depend on the GPUs visible (GPUS=N overrides the count):
#
#   trainer                   any (the CPU without a GPU): launch/gpu_check_trainer.py runs the megatron
#                             backend's GPU-only paths on the tiny DeepSeek-V4: bf16 log-probs against
#                             transformers' fp32 model, megatron-core's distributed optimizer with CPU offload
#                             (precision-aware when Transformer Engine imports), its checkpoint saved and
#                             loaded into a fresh backend, a step with a NaN advantage skipped (docs/faults.md).
#   colocated_push.<format>   1+ GPUs: the colocated path. The trainer and one SGLang engine share GPU 0
#                             (parallel.colocate=true): the engine releases its memory while the trainer
#                             works, and takes the weights by CUDA/HIP IPC tensor handles.
#   broadcast_push.<format>   2+ GPUs: the disaggregated path. The engine on GPU 0, the trainer on GPU 1: the
#                             weights are broadcast over an NCCL/RCCL process group, as between nodes.
#
# Each push check is `dsv4rl align`: one push, then the engine's log-probs against the trainer's on the
# engine's samples; the summary has the push's time, size and transport and the differences. A push check
# passes only when align's mean and max |trainer - engine| log-prob are under its format's bounds
# (LOGPROB_BOUNDS in launch/gpu_check_summary.py, printed beside them); align exiting 0 without them is
# "not measured", a failure too. The trainer check passes on its report's own checks. Formats
# (FORMATS, default "fp8_rollout bf16"): fp8_rollout as the reference recipe runs it: the engine's checkpoint
# holds MXFP4 experts as the release does (the tiny model written in that format, $OUT/model-<shape>), which
# SGLANG_DSV4_FP4_DEQUANT=1 de-quantizes to FP8 at load, and the trainer sends FP8; bf16 tells a kernel
# problem from a quantization one. fp8_mxfp4 is refused by validation (no SGLang MoE runner keeps MXFP4
# experts updatable). Push checks need `make install-sglang` (SGLANG_PYTHON); without it they are skipped,
# and the summary says so. About 2-4 minutes for the trainer on an H200, plus an engine start per push check.
#
#   launch/gpu_check.sh                      # the checks for the GPUs here, the tiny shapes
#   launch/gpu_check.sh --dry-run            # no GPU: the checks for 1 and for 2+ GPUs (each push check's
#                                            # command and `dsv4rl plan` of it) and the summary's JSON schema
#   SHAPE=kernel launch/gpu_check.sh         # DeepSeek-V4-Flash's per-layer shapes (3 layers, 16 experts),
#                                            # for SGLang kernels that refuse the tiny head sizes
#   FORMATS="bf16" launch/gpu_check.sh model.tiny.num_hidden_layers=2     # extra overrides go to every run
#
# Environment: GPUS (default: torch's device count), DEVICE (cluster.device; default from GPU 0's name:
# h100, h200, mi300x, mi325x, mi355x, else cpu), COMM (default nccl_h100, rccl_mi355x on ROCm),
# SGLANG_PYTHON (default .venv-sglang/bin/python), OUT (default runs/gpu_check), DSV4RL, PYTHON.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
DRY_RUN=""
if [[ ${1:-} == --dry-run ]]; then
  DRY_RUN=1
  shift
fi
if [[ -z ${DSV4RL:-} && -z ${VIRTUAL_ENV:-} && -f .venv/bin/activate ]]; then
  source .venv/bin/activate
fi
DSV4RL=${DSV4RL:-dsv4rl}
PYTHON=${PYTHON:-python3}
SGLANG_PYTHON=${SGLANG_PYTHON:-.venv-sglang/bin/python}
OUT=${OUT:-runs/gpu_check}
FORMATS=${FORMATS:-"fp8_rollout bf16"}
SHAPE=${SHAPE:-tiny}
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"

# What is here: GPU count, GPU 0's name, whether torch is a ROCm build (one line each, from torch).
read -r -d '' PROBE <<'EOF'
try:
    import torch
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    name = torch.cuda.get_device_name(0) if n else "cpu"
    rocm = bool(torch.version.hip)
except Exception:
    n, name, rocm = 0, "cpu", False
print(n); print(name); print(int(rocm))
EOF
if [[ -n $DRY_RUN ]]; then
  detected=(0 cpu 0)
else
  mapfile -t detected < <("$PYTHON" -c "$PROBE")
fi
GPUS=${GPUS:-${detected[0]:-0}}
GPU_NAME=${detected[1]:-cpu}
case "$GPU_NAME" in
  *H200*) kind=h200 ;;
  *H100*) kind=h100 ;;
  *MI355*|*MI350*) kind=mi355x ;;
  *MI325*) kind=mi325x ;;
  *MI300*) kind=mi300x ;;
  *) kind=cpu ;;  # the family is unknown: SGLang's MoE runner stays `auto`
esac
DEVICE=${DEVICE:-$kind}
if [[ ${detected[2]:-0} == 1 ]]; then COMM=${COMM:-rccl_mi355x}; else COMM=${COMM:-nccl_h100}; fi

model=(model.tiny.sliding_window=128 model.tiny.hca_compress_rate=128)  # what SGLang serves (docs/sglang.md)
case $SHAPE in
  tiny) ;;
  kernel)
    model+=(
      model.tiny.hidden_size=4096 model.tiny.num_attention_heads=64 model.tiny.head_dim=512
      model.tiny.qk_rope_head_dim=64 model.tiny.q_lora_rank=1024 model.tiny.o_groups=8
      model.tiny.o_lora_rank=1024 model.tiny.moe_intermediate_size=2048 model.tiny.n_routed_experts=16
      model.tiny.num_experts_per_tok=6 model.tiny.index_n_heads=64 model.tiny.index_head_dim=128
      model.tiny.index_topk=512 model.tiny.max_position_embeddings=4096
    )
    ;;
  *) echo "SHAPE must be tiny or kernel, got $SHAPE" >&2; exit 2 ;;
esac
common=(
  recipe=tiny_arith "${model[@]}"
  parallel.rollout.engine=sglang "engine.python=$SGLANG_PYTHON" "cluster.device=$DEVICE" "comm=$COMM"
  parallel.rollout.gpus_per_engine=1 parallel.rollout.mem_fraction_static=0.3 engine.startup_timeout_s=1200
  sync.verify.checksum=false
  align.prompts=16 align.samples_per_prompt=4 align.max_new_tokens=8
)
MXFP4_MODEL="$OUT/model-$SHAPE"

# The overrides of one push check (name path.format), one a line.
check_args() {
  local path=${1%%.*} format=${1#*.}
  printf '%s\n' "${common[@]}" "quant=$format" "run.dir=$OUT/$1"
  if [[ $path == colocated_push ]]; then
    printf '%s\n' cluster.gpus_per_node=1 parallel.colocate=true
  else
    printf '%s\n' cluster.gpus_per_node=2 parallel.colocate=false
  fi
  if [[ $format == fp8_rollout ]]; then  # the release's MXFP4 experts, de-quantized at load (the recipe's env)
    printf '%s\n' "model.path=$(realpath -m "$MXFP4_MODEL")"
  fi
}

# The tiny model in the release's format (MXFP4 experts), once, for the fp8_rollout checks.
build_mxfp4_model() {
  "$PYTHON" - "$MXFP4_MODEL" "${model[@]}" <<'EOF'
import sys
from dsv4rl.config.compose import compose
from dsv4rl.model.model_dir import materialize_model

cfg = compose("tiny_arith", [*sys.argv[2:], "quant=fp8_mxfp4"])
materialize_model(cfg.model, sys.argv[1], cfg.quant)
EOF
}

mkdir -p "$OUT"
engines=1
[[ -x $SGLANG_PYTHON ]] || engines=0  # no SGLang here: the push checks are reported as skipped
if [[ " $FORMATS " == *" fp8_rollout "* ]] && [[ -n $DRY_RUN ]] || (( engines && GPUS > 0 )); then
  build_mxfp4_model > "$OUT/model.log" 2>&1 || { echo "building $MXFP4_MODEL failed: $OUT/model.log" >&2; exit 1; }
fi

if [[ -n $DRY_RUN ]]; then  # each push check of 2 GPUs (1 GPU's are among them) planned; nothing starts
  folder="$OUT/dry-run"
  mkdir -p "$folder"
  while read -r name; do
    [[ $name == trainer ]] && continue
    mapfile -t args < <(check_args "$name")
    printf '%s\n' "${args[@]}" "$@" > "$folder/$name.argv"
    "$DSV4RL" plan "${args[@]}" "$@" --json --skip-engine-check > "$folder/$name.plan.json" 2> "$folder/$name.log"
    echo $? > "$folder/$name.rc"
  done < <("$PYTHON" launch/gpu_check_summary.py checks 2 $FORMATS)
  exec "$PYTHON" launch/gpu_check_summary.py dry-run "$OUT" --cluster-device "$DEVICE" --comm "$COMM" \
    --shape "$SHAPE" --formats $FORMATS
fi

rm -f "$OUT/trainer/trainer.json"  # never judge an earlier run's report
trainer_args=("$OUT/trainer")
(( GPUS == 0 )) && trainer_args+=(--cpu)
timeout 900 "$PYTHON" -m torch.distributed.run --nproc-per-node 1 --master-port "${TRAINER_PORT:-29611}" \
  launch/gpu_check_trainer.py "${trainer_args[@]}" > "$OUT/trainer.log" 2>&1
echo $? > "$OUT/trainer.rc"

if (( engines )); then
  while read -r name; do
    [[ $name == trainer ]] && continue
    mapfile -t args < <(check_args "$name")
    "$DSV4RL" align "${args[@]}" "$@" --json > "$OUT/$name.json" 2> "$OUT/$name.log"
    echo $? > "$OUT/$name.rc"
  done < <("$PYTHON" launch/gpu_check_summary.py checks "$GPUS" $FORMATS)
fi

"$PYTHON" launch/gpu_check_summary.py summary "$OUT" --gpus "$GPUS" --device "$GPU_NAME" \
  --cluster-device "$DEVICE" --comm "$COMM" --shape "$SHAPE" --sglang "$SGLANG_PYTHON" --engines "$engines" \
  --formats $FORMATS
