#!/usr/bin/env bash
# fp8vit-bench on the block-family models of docs/performance.md: the bench's four default variants
# (timm bf16 eager, timm + torch.compile, torchao float8 + compile, fp8vit FP8 with CUDA graphs) in one
# run per model, logs bench/MODEL_bBATCH_default4_h200.{log,json} under $OUT (default docs/results).
# Three parts of under 10 minutes each:
#   bash docs/perf/bench_families.sh 1|2|3|all
set -o pipefail
here=$(dirname "$0")
bench() { timeout "$2" bash "$here/h200.sh" "bench:$1" | tail -9; }
case $1 in
  1) bench vit_base_patch16_rope_224:128 200; bench deit3_base_patch16_224:128 200 ;;
  2) bench eva02_base_patch14_224:128 260; bench eva02_large_patch14_224:64 260 ;;
  3) bench vit_pe_core_large_patch14_336:32 300; bench aimv2_large_patch14_224:64 260 ;;
  all) for p in 1 2 3; do bash "$0" $p; done ;;
  *) echo "usage: bash docs/perf/bench_families.sh 1|2|3|all"; exit 2 ;;
esac
