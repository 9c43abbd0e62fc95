#!/usr/bin/env bash
# The CPU demo: a tiny DeepSeek-V4 learns one-digit addition with GRPO on this machine (recipe tiny_arith:
# FSDP2 trainer + dsv4rl's reference engine over gloo; no GPU, no SGLang, no Slurm).
#   launch/local_cpu.sh [overrides]      e.g. launch/local_cpu.sh train.steps=20 parallel=cpu_fsdp2
# `dsv4rl plan recipe=tiny_arith` shows the processes it starts.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ -z ${DSV4RL:-} && -z ${VIRTUAL_ENV:-} && -f .venv/bin/activate ]]; then
  source .venv/bin/activate
fi
RUN_DIR=${RUN_DIR:-runs/tiny_arith-$(date +%Y%m%d-%H%M%S)}
exec "${DSV4RL:-dsv4rl}" train recipe=tiny_arith run.dir="$RUN_DIR" "$@"
