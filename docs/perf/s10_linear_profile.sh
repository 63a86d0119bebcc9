#!/usr/bin/env bash
# Session 10 H200 run: the CaiT linear-swap test, fallback="linear" vs timm bf16 eager on Swin-B and
# BEiT-B, and per-kernel profiles of EVA02-B b128 (fp8vit graphed vs timm + torch.compile).
#   OUT=$OUT bash docs/perf/s10_linear_profile.sh
out=${OUT:-docs/results}
bash docs/perf/h200.sh tests:tests/gpu/test_linear_gpu.py \
  bench:swin_base_patch4_window7_224:128:timm-bf16,fp8vit-fp8-delayed-linear,fp8vit-fp8-current-linear \
  bench:beit_base_patch16_224:128:timm-bf16,fp8vit-fp8-delayed-linear,fp8vit-fp8-current-linear
. /tmp/te_env.sh
export PYTHONPATH=$PWD:$PYTHONPATH  # keep te_env.sh's TE path
for v in fp8vit-fp8-delayed-graphed timm-bf16-compile; do
  python3 -m fp8vit.tools.profiling --model eva02_base_patch14_224 --batch-size 128 --variant $v \
    --kernels "$out/profile_eva02_base_128_$v.kernels.txt" > "$out/profile_eva02_base_128_$v.log" 2>&1
  tail -40 "$out/profile_eva02_base_128_$v.log"
done
