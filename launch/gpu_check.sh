#!/usr/bin/env bash
# The GPU check, on one GPU, in two halves; prints one JSON object and exits 1 when a check that ran failed.
#
# 1. The trainer (needs `make install GPU=1`, or torch with CUDA plus dsv4rl's dependencies: transformers
#    5.23, megatron-core 0.16.1): launch/gpu_check_trainer.py runs the megatron backend's GPU-only paths on
#    the tiny DeepSeek-V4: bf16 log-probs against transformers' fp32 model, megatron-core's distributed
#    optimizer with CPU offload (precision-aware when Transformer Engine imports), a distributed-optimizer
#    checkpoint saved and loaded into a fresh backend, which must then step to the same weights, and a step
#    with a NaN advantage, which that optimizer must skip without a trace (docs/faults.md).
# 2. The engines (needs `make install-sglang` too; skipped, and said so, without SGLANG_PYTHON): one real
#    SGLang engine per weight format, the trainer's weights pushed into it over NCCL/RCCL, and the engine's
#    log-probs compared with the trainer's (`dsv4rl align`): per format the push time and size and the
#    differences. fp8_mxfp4 is refused by validation (no SGLang MoE backend keeps MXFP4 experts updatable).
# A machine where SGLang cannot be installed runs half 1 only: it checks the trainer, not SGLang's update path.
# About 2-4 minutes for half 1 on an H200; half 2 adds an engine start per format.
#
#   launch/gpu_check.sh                      # formats bf16 fp8_rollout, the tiny shapes
#   SHAPE=kernel launch/gpu_check.sh         # DeepSeek-V4-Flash's per-layer shapes (3 layers, 16 experts),
#                                            # for SGLang kernels that refuse the tiny head sizes
#   FORMATS="bf16" launch/gpu_check.sh model.tiny.num_hidden_layers=2     # extra overrides go to every run
#   DRY_RUN=1 launch/gpu_check.sh            # no GPU: half 1 on the CPU (gloo), half 2 planned (`dsv4rl plan`)
#
# Environment: SGLANG_PYTHON (default .venv-sglang/bin/python), OUT (default runs/gpu_check),
# COMM (default nccl_h100; rccl_mi355x on AMD), DSV4RL (the dsv4rl command).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ -z ${DSV4RL:-} && -z ${VIRTUAL_ENV:-} && -f .venv/bin/activate ]]; then
  source .venv/bin/activate
fi
DSV4RL=${DSV4RL:-dsv4rl}
SGLANG_PYTHON=${SGLANG_PYTHON:-.venv-sglang/bin/python}
OUT=${OUT:-runs/gpu_check}
FORMATS=${FORMATS:-"bf16 fp8_rollout"}
SHAPE=${SHAPE:-tiny}
COMM=${COMM:-nccl_h100}
PYTHON=${PYTHON:-python3}

common=(
  recipe=tiny_arith
  parallel.rollout.engine=sglang "engine.python=$SGLANG_PYTHON"
  cluster.gpus_per_node=1 parallel.rollout.gpus_per_engine=1 parallel.colocate=true
  parallel.rollout.mem_fraction_static=0.3 engine.startup_timeout_s=1200
  "comm=$COMM" sync.verify.checksum=false sync.verify.logprob_probe=true
  align.prompts=16 align.samples_per_prompt=4 align.max_new_tokens=8
  # SGLang serves CSA at compress ratio 4, HCA at 128 and a 128-token window only (docs/sglang.md)
  model.tiny.sliding_window=128 model.tiny.hca_compress_rate=128
)
case $SHAPE in
  tiny) ;;
  kernel)
    common+=(
      model.tiny.hidden_size=4096 model.tiny.num_attention_heads=64 model.tiny.head_dim=512
      model.tiny.qk_rope_head_dim=64 model.tiny.q_lora_rank=1024 model.tiny.o_groups=8
      model.tiny.o_lora_rank=1024 model.tiny.moe_intermediate_size=2048 model.tiny.n_routed_experts=16
      model.tiny.num_experts_per_tok=6 model.tiny.index_n_heads=64 model.tiny.index_head_dim=128
      model.tiny.index_topk=512 model.tiny.max_position_embeddings=4096
    )
    ;;
  *) echo "SHAPE must be tiny or kernel, got $SHAPE" >&2; exit 2 ;;
esac

mkdir -p "$OUT"
trainer_args=("$OUT/trainer")
[[ -n ${DRY_RUN:-} ]] && trainer_args+=(--cpu)
PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" timeout 900 "$PYTHON" -m torch.distributed.run --nproc-per-node 1 \
  --master-port "${TRAINER_PORT:-29611}" launch/gpu_check_trainer.py "${trainer_args[@]}" > "$OUT/trainer.log" 2>&1
echo $? > "$OUT/trainer.rc"

engines=1
if [[ -z ${DRY_RUN:-} && ! -x $SGLANG_PYTHON ]]; then
  engines=0  # no SGLang here: the engine half is reported as skipped
  FORMATS=""
fi
for format in $FORMATS; do
  args=("${common[@]}" "quant=$format" "run.dir=$OUT/$SHAPE")
  if [[ $format == fp8_rollout ]]; then  # the tiny checkpoint stores FP8 experts: nothing to convert at load
    args+=("~quant.engine_env.SGLANG_DSV4_FP4_DEQUANT" "+quant.engine_env.SGLANG_DSV4_FP4_EXPERTS=0")
  fi
  if [[ -n ${DRY_RUN:-} ]]; then
    "$DSV4RL" plan "${args[@]}" "$@" --json --skip-engine-check > "$OUT/$format.plan.json" 2> "$OUT/$format.log"
  else
    "$DSV4RL" align "${args[@]}" "$@" --json > "$OUT/$format.json" 2> "$OUT/$format.log"
  fi
  echo $? > "$OUT/$format.rc"
done

"$PYTHON" - "$OUT" "$SHAPE" "$engines" "$SGLANG_PYTHON" ${DRY_RUN:+dry} $FORMATS <<'EOF'
import json, sys
from pathlib import Path

out, shape, engines, sglang, rest = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1", sys.argv[4], sys.argv[5:]
dry = bool(rest) and rest[0] == "dry"
formats = rest[1:] if dry else rest
rc = int((out / "trainer.rc").read_text())
trainer_report = out / "trainer" / "trainer.json"
if trainer_report.exists():
    trainer = json.loads(trainer_report.read_text())
else:
    trainer = {"ok": False, "exit_code": rc,
               "error": (out / "trainer.log").read_text().strip().splitlines()[-20:]}
results = {}
for name in formats:
    rc = int((out / f"{name}.rc").read_text())
    entry = {"ok": rc == 0, "exit_code": rc}
    if rc != 0:
        entry["error"] = (out / f"{name}.log").read_text().strip().splitlines()[-20:]
    elif dry:
        plan = json.loads((out / f"{name}.plan.json").read_text())
        entry["engine_argv"] = plan["nodes"][0]["processes"][0]["argv"]
        entry["engine_env"] = plan["quant"]["engine_env"]
        entry["warnings"] = plan["warnings"]
    else:
        report = json.loads((out / f"{name}.json").read_text())
        sync = report["sync"]
        entry.update(
            push_s=sync["seconds"], push_bytes=sync["bytes"], push_tensors=sync["tensors"],
            logprob_mean_abs_diff=report["mean_abs_diff"], logprob_max_abs_diff=report["max_abs_diff"],
            tokens=report["tokens"],
        )
    results[name] = entry
skipped = None if engines else f"no SGLang interpreter at {sglang} (make install-sglang): SGLang not checked"
print(json.dumps({"shape": shape, "dry_run": dry, "trainer": trainer, "formats": results,
                  "engines_skipped": skipped}, indent=2))
sys.exit(0 if trainer["ok"] and all(e["ok"] for e in results.values()) else 1)
EOF
