#!/usr/bin/env bash
# docs/scaling.md at world size 1: examples/train_vit.py under torchrun with one process, FP8 delayed
# scaling, AdamW, synthetic data, one run per mode and batch, logs
# scaling/MODEL_bBATCH_MODE_ws1_h200.log under $OUT (default docs/results). Modes: ddp (eager blocks, --eager),
# ddp-graphs (--cuda-graphs), fsdp (FSDP2, bf16 compute), fsdp-fp8w (FSDP2 + FP8 primary weights).
#   bash docs/perf/scaling_ws1.sh MODEL MODE:BATCH [MODE:BATCH ...]
#   bash docs/perf/scaling_ws1.sh vit_huge_patch14_224 ddp:448 ddp-graphs:384 fsdp:448 fsdp-fp8w:448 ddp:528
# STEPS (default 30) training steps (the example leaves the first fifth untimed), TIMEOUT (default 110) seconds per run.
set -o pipefail
. "$(dirname "$0")/te_env.sh"
mkdir -p "$out/scaling"
model=$1; shift
for run in "$@"; do
  mode=${run%%:*}; b=${run##*:}
  case $mode in ddp) flag= ;; ddp-graphs) flag=--cuda-graphs ;; fsdp) flag=--fsdp ;;
    fsdp-fp8w) flag="--fsdp --fp8-weights" ;; *) echo "unknown mode $mode"; exit 2 ;; esac
  log="$out/scaling/${model}_b${b}_${mode}_ws1_${gpu}.log"
  echo "== $model $mode batch $b"
  timeout "${TIMEOUT:-110}" torchrun --standalone --nproc-per-node 1 examples/train_vit.py $flag --model "$model" \
    --batch-size "$b" --steps "${STEPS:-30}" --price-per-hour 3.5 > "$log" 2>&1
  echo "rc $?"; grep -E "^done|OutOfMemory" "$log" | tail -2
done
