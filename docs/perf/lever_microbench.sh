#!/usr/bin/env bash
# The microbenchmarks behind rows 19, 22, 24 and 25 of docs/performance.md's lever table, logs
# levers/*_microbench_h200.log under $OUT (default docs/results).   bash docs/perf/lever_microbench.sh
set -o pipefail
. "$(dirname "$0")/te_env.sh"
mkdir -p "$out/levers"
for s in rope_qkv_bench:rope_te_fused_qkv layerscale_bench:layerscale_cost \
         layerscale_triton_bench:layerscale_backward_triton rope_packed_bench:rope_packed_qkv_triton; do
  python3 "docs/perf/${s%%:*}.py" 2>&1 | tee "$out/levers/${s##*:}_microbench_${gpu}.log" | tail -6
done
