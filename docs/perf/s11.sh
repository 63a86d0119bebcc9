#!/usr/bin/env bash
# Session 11's H200 plan (written without device time in session 11; run by the next session with
# fresh device minutes). Three calls, each under the 10-minute limit; logs under $OUT.
#   run(command="OUT=$OUT bash docs/perf/s11.sh 1", carry=[".kit"])   and likewise 2, 3
#
# 1. correctness of what landed unrun: the whole GPU suite (EVA GQA / gated attention / post-norm,
#    shared attention, RoPE angles once per table, diagnose with the rope table, the post-norm
#    MLP's gated kernel, tests/gpu/test_distributed_gpu.py at world size 1), then EVA02-B against
#    timm eager and compile to check the merged EVA attention did not regress (47.5 ms before).
# 2. where the unmet targets lose (issue 23): per-kernel profiles of EVA02-L b64, RoPE ViT-B b128 and
#    PE-core-L/14 336 b32, graphed FP8; the RoPE and LayerScale microbenchmarks; then the EVA-style
#    convergence run (8 seeds, timm-bf16 / fp8vit-bf16 / fp8-delayed: ~3 min, as the 12-seed digits run).
# 3. world-size-1 scaling measurements for docs/scaling.md (issue 25): ViT-H and ViT-g/14 under DDP,
#    FSDP2 bf16 and FSDP2 + FP8 weights.
# 4. (optional) timm + compile profiles of EVA02-L and RoPE ViT-B, for the side-by-side tables.
# A machine with several GPUs, if status lists one: `fp8vit-bench --model base --nproc 1 2 ...` and
# `torchrun --standalone --nproc-per-node N tests/gpu/distributed_check.py` (docs/scaling.md).
set -o pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-docs/results}
H=docs/perf/h200.sh
V=timm-bf16,timm-bf16-compile,fp8vit-fp8-delayed-graphed
case $1 in
  1)
    bash $H tests:tests/gpu
    bash $H bench:eva02_base_patch14_224:128:$V ;;
  2)
    bash $H profile:eva02_large_patch14_224:64 profile:vit_base_patch16_rope_224:128 \
      profile:vit_pe_core_large_patch14_336:32
    . /tmp/te_env.sh; export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
    python3 docs/perf/rope_qkv_bench.py 2>&1 | tee "$out/rope_qkv_bench.log" | tail -6
    python3 docs/perf/layerscale_bench.py 2>&1 | tee "$out/layerscale_bench.log" | tail -6
    mkdir -p "$out/convergence"
    python3 examples/convergence.py --setup eva-digits --seeds 8 --workers 12 \
      --variants timm-bf16 fp8vit-bf16 fp8-delayed \
      --json "$out/convergence/conv_eva_digits.json" --plot "$out/convergence/conv_eva_digits.png" \
      2>&1 | tee "$out/convergence/conv_eva_digits.log" | tail -12 ;;
  3)
    . /tmp/te_env.sh 2>/dev/null || bash .kit/setup.sh > "$out/te_setup.log" 2>&1; . /tmp/te_env.sh
    export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
    for m in vit_huge_patch14_224:64 vit_giant_patch14_224:32; do
      IFS=: read -r model batch <<< "$m"
      for mode in ddp fsdp fsdp-fp8w; do
        case $mode in ddp) flag= ;; fsdp) flag=--fsdp ;; fsdp-fp8w) flag="--fsdp --fp8-weights" ;; esac
        timeout 100 torchrun --standalone --nproc-per-node 1 examples/train_vit.py $flag --model $model \
          --batch-size $batch --steps 40 --price-per-hour 3.5 2>&1 | tee "$out/scale_ws1_${model}_${mode}.log" | tail -4
      done
    done ;;
  4)  # if device time is left: timm + compile profiles beside fp8vit's (each compiles for 1-2 min)
    bash $H profile:eva02_large_patch14_224:64:timm-bf16-compile profile:vit_base_patch16_rope_224:128:timm-bf16-compile ;;
  *) echo "usage: bash docs/perf/s11.sh 1|2|3|4"; exit 2 ;;
esac
