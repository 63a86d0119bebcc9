#!/usr/bin/env bash
# Session 12's H200 call (one, under the 10-minute limit): levers 22 (LayerScale in the stream's
# dtype) and 23 (the padded inner norm in bf16) against timm eager and compile, each model one
# fp8vit-bench run; PE-core again (was its bimodal synchronized step a one-off?); then the GPU tests
# the change touches, in the time left.
#   run(command="OUT=$OUT bash docs/perf/s12.sh", carry=[".kit"])
set -o pipefail
cd "$(dirname "$0")/../.."
H=docs/perf/h200.sh
V=timm-bf16,timm-bf16-compile,fp8vit-fp8-delayed-graphed
bash $H bench:vit_base_patch16_rope_224:128:$V bench:eva02_large_patch14_224:64:$V \
  bench:vit_pe_core_large_patch14_336:32:$V
left=$((575 - SECONDS))
echo "GPU tests with ${left} s left"
timeout $left bash $H tests:tests/gpu/test_distributed_gpu.py,tests/gpu/test_eva_gpu.py,tests/gpu/test_mlp_gpu.py,tests/gpu/test_block_gpu.py
