#!/usr/bin/env bash
# docs/scaling.md on a machine with N >= 2 GPUs (not run yet): the distributed GPU check (DDP with
# graphed blocks and FSDP2 against one process, the FP8 scales on every rank) and the scaling
# efficiency of ViT-B and ViT-H (timm bf16, fp8vit graphed) from 1 to N processes. Logs under $OUT
# (default docs/results): scaling/distributed_check_NGPU_h200.log, scaling/vit_MODEL_b128_nproc1-N_h200.{log,json}.
#   bash docs/perf/scaling_multi_gpu.sh
set -o pipefail
. "$(dirname "$0")/te_env.sh"
mkdir -p "$out/scaling"
n=$(nvidia-smi -L | wc -l)
[ "$n" -ge 2 ] || { echo "needs 2 or more GPUs ($n visible)"; exit 2; }
timeout 300 torchrun --standalone --nproc-per-node "$n" tests/gpu/distributed_check.py 2>&1 \
  | tee "$out/scaling/distributed_check_${n}gpu_${gpu}.log" | tail -15
for m in base huge; do
  timeout 240 python3 -m fp8vit.tools.bench --model $m --batch-size 128 --nproc 1 "$n" \
    --variants timm-bf16 fp8vit-fp8-delayed-graphed --json "$out/scaling/vit_${m}_b128_nproc1-${n}_${gpu}.json" 2>&1 \
    | tee "$out/scaling/vit_${m}_b128_nproc1-${n}_${gpu}.log" | tail -8
done
