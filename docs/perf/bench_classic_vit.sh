#!/usr/bin/env bash
# fp8vit-bench on timm's ViT-B/16, ViT-L/16 and ViT-H/16 at batch 128 with ten variants in one run per
# model (docs/performance.md), a repeat of ViT-H's graphed variants with the pipelined timing, and
# ViT-H's largest batch with every second block's MLP recomputed. Logs under $OUT (default
# docs/results), bench/*_$gpu.{log,json} ($gpu: h200, h100). One part per call (each under 10 minutes):
#   bash docs/perf/bench_classic_vit.sh base|large|huge|huge-graphed|huge-maxbatch
set -o pipefail
. "$(dirname "$0")/te_env.sh"
mkdir -p "$out/bench"
V="timm-bf16 fp8vit-fp8-delayed-graphed fp8vit-fp8-delayed-cudnn-norm-graphed fp8vit-fp8-delayed te-layer-fp8-graphed fp8vit-bf16-graphed fp8vit-bf16 te-layer-fp8 timm-bf16-compile torchao-fp8-compile"
bench() {  # name, then fp8vit-bench arguments
  local name=$1; shift
  python3 -m fp8vit.tools.bench "$@" --json "$out/bench/$name.json" 2>&1 | tee "$out/bench/$name.log" | tail -16
}
case $1 in
  base) bench vit_base_patch16_224_b128_all10_${gpu} --model base --batch-size 128 --steps 30 --warmup 10 --variants $V ;;
  # ViT-L and ViT-H: fewer steps and no pipelined pass, so that a run fits in 10 minutes
  large) bench vit_large_patch16_224_b128_all10_${gpu} --model large --batch-size 128 --steps 25 --warmup 8 --no-pipelined --variants $V ;;
  huge) bench vit_huge_patch16_224_b128_all10_${gpu} --model huge --batch-size 128 --steps 25 --warmup 8 --no-pipelined --variants $V \
          --plot "$out/bench/vit_huge_patch16_224_b128_all10_${gpu}.png" ;;
  huge-graphed) bench vit_huge_patch16_224_b128_graphed3_${gpu} --model huge --batch-size 128 --steps 30 --warmup 10 \
          --variants timm-bf16 fp8vit-fp8-delayed-graphed fp8vit-fp8-delayed-cudnn-norm-graphed ;;
  huge-maxbatch) bench vit_huge_patch16_224_b128_maxbatch_recompute2_${gpu} --model huge --batch-size 128 \
          --variants timm-bf16 fp8vit-fp8-delayed-cudnn-norm-graphed --mlp-recompute 2 --max-batch ;;
  *) echo "usage: bash docs/perf/bench_classic_vit.sh base|large|huge|huge-graphed|huge-maxbatch"; exit 2 ;;
esac
