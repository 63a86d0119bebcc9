#!/usr/bin/env bash
# Session 14's H200 plan (written in session 13, run in session 14 at commit 017e09d: logs in
# docs/results/s14/, results in docs/performance.md "Session 14"). Each call < 10 min.
#   mkdir -p .kit && cp ../shared/te-kit/* .kit/
#   run(command="OUT=$OUT bash docs/perf/s14.sh 1", carry=[".kit"])   then 2, 3; copy $OUT into docs/results/s14/
#
# 1. The library as shipped after session 13 (lever 24 in, lever 25 out) on the two LayerScale models
#    benched with lever 25 in: RoPE ViT-B/16 b128 (35.0 ms, 2.25x with 24 + 25; the microbenchmark
#    puts the shipped step ~1.4 ms faster: predicted ~33.6 ms, ~2.3x) and DeiT3-B/16 b128 (30.6 ms,
#    1.80x; lever 25 never touched it: predicted unchanged within the 5% drift). Default variants:
#    torchao float8 + compile in the same run as timm eager, compile and fp8vit graphed. Then the
#    whole GPU suite on the shipped code.
# 2-3. The other block-family rows with torchao in the same run (issue 23 asks for both alternatives
#    in one run; session 12's runs had three variants): EVA02-B b128, EVA02-L b64 (torchao fails:
#    hidden 2730), PE-core-L/14 336 b32, AIMv2-L/14 b64. Predicted: fp8vit graphed within 5% of the
#    families.md rows (nothing on these paths changed since), torchao below compile as before.
# multi. Only if `status` lends a machine with several GPUs: `bash docs/perf/s13.sh multi`.
set -o pipefail
cd "$(dirname "$0")/../.."
export OUT=${OUT:-docs/results}
bench() { timeout "$2" bash docs/perf/h200.sh "bench:$1" | tail -9; }
case $1 in
  1) bench vit_base_patch16_rope_224:128 200; bench deit3_base_patch16_224:128 200
     bash docs/perf/h200.sh tests:tests/gpu | tail -12 ;;
  2) bench eva02_base_patch14_224:128 260; bench eva02_large_patch14_224:64 260 ;;
  3) bench vit_pe_core_large_patch14_336:32 300; bench aimv2_large_patch14_224:64 260 ;;
  *) echo "usage: bash docs/perf/s14.sh 1|2|3"; exit 2 ;;
esac
