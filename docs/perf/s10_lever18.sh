#!/usr/bin/env bash
# Session 10, lever 18 (TE's gated kernel in the unfused gated MLP): the MLP and EVA GPU tests, then
# EVA02-B b128 and EVA02-L b64 against timm eager and torch.compile in one run each, and the graphed
# EVA02-B profile after the lever.   OUT=$OUT bash docs/perf/s10_lever18.sh
out=${OUT:-docs/results}
V=timm-bf16,timm-bf16-compile,fp8vit-fp8-delayed-graphed
bash docs/perf/h200.sh tests:tests/gpu/test_mlp_gpu.py,tests/gpu/test_eva_gpu.py bench:eva02_base_patch14_224:128:$V
. /tmp/te_env.sh
export PYTHONPATH=$PWD:$PYTHONPATH
v=fp8vit-fp8-delayed-graphed
python3 -m fp8vit.tools.profiling --model eva02_base_patch14_224 --batch-size 128 --variant $v \
  --kernels "$out/profile_eva02_base_128_${v}_lever18.kernels.txt" > "$out/profile_eva02_base_128_${v}_lever18.log" 2>&1
grep -A10 "wall" "$out/profile_eva02_base_128_${v}_lever18.log"
bash docs/perf/h200.sh bench:eva02_large_patch14_224:64:$V
