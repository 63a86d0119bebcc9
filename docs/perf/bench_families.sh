#!/usr/bin/env bash
# fp8vit-bench on every model of docs/performance.md's peers table, one run per model with its peers:
# timm bf16 eager, timm + torch.compile, torchao float8 + compile and fp8vit FP8 with CUDA graphs (the
# bench's four default variants: bench/MODEL_bBATCH_default4_$gpu.{log,json} under $OUT, default
# docs/results), and fp8vit graphed + torch.compile where a model has unfused parts that compile
# speeds up (hybrids, Swin's window ops, BEiT: bench/MODEL_bBATCH_all5_$gpu.*). Each part fits one
# device call (under 10 minutes on an H100, timings from the runs in docs/results):
#   bash docs/perf/bench_families.sh 1|2|3|4|5|6|7|8|all   (1 = 1a then 1b: ViT-B, ViT-L; together
#   they passed 560 s on an H100 in session 53, so run them as two calls)
# then point docs/perf/peers_table.args at the new JSON files and regenerate the page's table.
set -o pipefail
here=$(dirname "$0")
ALL5=timm-bf16,timm-bf16-compile,torchao-fp8-compile,fp8vit-fp8-delayed-graphed,fp8vit-fp8-delayed-graphed-compile
bench() { timeout "$2" bash "$here/h200.sh" "bench:$1" | tail -9; }
case $1 in
  1) bash "$0" 1a; bash "$0" 1b ;;
  1a) bench vit_base_patch16_224:128 300 ;;   # ~4.5 min (H100, with the processes' start)
  1b) bench vit_large_patch16_224:128 420 ;;  # ~5-6 min
  2) bench huge:128 540 ;;  # ViT-H/16 (timm has no vit_huge_patch16_224): ~5-6 min
  3) bench vitamin_large_224:64:$ALL5:all5 540 ;;                               # ~5.5 min
  4) bench beit_base_patch16_224:128:$ALL5:all5 300; bench deit3_base_patch16_224:128 240 ;;
  5) bench vit_base_patch16_rope_224:128 200; bench eva02_base_patch14_224:128 260 ;;
  6) IMG_SIZE=336 bench vit_pe_core_large_patch14_336:32 300; bench aimv2_large_patch14_224:64 260 ;;
  7) bench eva02_large_patch14_224:64 260; bench convnext_base:128:$ALL5:all5 300 ;;
  8) bench swin_base_patch4_window7_224:128:$ALL5:all5 480 ;;                   # ~6.5 min
  all) for p in 1 2 3 4 5 6 7 8; do bash "$0" $p; done ;;
  *) echo "usage: bash docs/perf/bench_families.sh 1|1a|1b|2|3|4|5|6|7|8|all"; exit 2 ;;
esac
