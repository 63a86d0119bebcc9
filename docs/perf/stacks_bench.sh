#!/usr/bin/env bash
# Speed inside the training stacks (docs/perf/stacks_bench.py): bf16 vs fp8vit FP8 of timm's ViT-B/16 and
# ViT-H/16 at batch 128 in a plain loop, Lightning (precision="bf16-mixed", and FP8VitPrecision), HF
# accelerate and timm's train.py, one fresh process per run. Log and JSON under $OUT (default docs/results):
# stacks/stacks_<models>[_<stacks>][_r<N>]_h200.{log,json}.
#   bash docs/perf/stacks_bench.sh [MODELS] [STACKS] [more stacks_bench.py options]
#   bash docs/perf/stacks_bench.sh vit_base_patch16_224,vit_huge_patch16_224 plain,lightning,lightning-plugin,accelerate
#   bash docs/perf/stacks_bench.sh vit_base_patch16_224,vit_huge_patch16_224 timm-train
#   bash docs/perf/stacks_bench.sh vit_base_patch16_224 plain,lightning,lightning-plugin,accelerate --repeats 3
# --repeats N runs every configuration N times in interleaved rounds and tables the median of the runs'
# medians with their spread: on the H200 one process's step time sits up to ~5% from the next's, as
# large as some gaps between stacks. N times the time; the files get an _r<N> suffix.
# MODELS default vit_base_patch16_224,vit_huge_patch16_224 (ViT-H/16: timm's vit_huge_patch14_224 at
# patch 16, the model docs/performance.md times); STACKS default all five. The first two commands
# above take about 6 and 3 minutes on an H200 (the script prints its estimate first).
# Lightning and accelerate: used as installed; where they do not import, their wheels (and their
# dependencies' wheels) are installed from WHEELS (default .wheels, carried to the GPU machine) into
# /tmp/site, as .kit/setup.sh installs TE.
set -o pipefail
. "$(dirname "$0")/te_env.sh"
models=${1:-vit_base_patch16_224,vit_huge_patch16_224}
stacks=${2:-plain,lightning,lightning-plugin,accelerate,timm-train}
shift $(( $# < 2 ? $# : 2 ))
wheels=${WHEELS:-.wheels}
if ! python3 -c 'import lightning, accelerate' 2>/dev/null; then
  if ls "$wheels"/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
      "$wheels"/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    python3 -c 'import lightning as L, accelerate as A; print("lightning", L.__version__, "accelerate", A.__version__)' \
      || exit 1
  else
    echo "stacks_bench: lightning or accelerate does not import and $wheels holds no wheels: their runs will fail"
  fi
fi
mkdir -p "$out/stacks"
name=stacks_${models//,/_}
[ "$stacks" = plain,lightning,lightning-plugin,accelerate,timm-train ] || name=${name}_${stacks//,/_}
repeats=
prev=
for arg in "$@"; do  # --repeats N or --repeats=N: kept apart from the single-run files of the same plan
  case $arg in --repeats=*) repeats=${arg#--repeats=} ;; esac
  [ "$prev" = --repeats ] && repeats=$arg
  prev=$arg
done
[ -z "$repeats" ] || [ "$repeats" = 1 ] || name=${name}_r${repeats}
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
python3 docs/perf/stacks_bench.py --models "$models" --stacks "$stacks" --batch-size 128 --steps 30 --warmup 10 \
  --json "$out/stacks/${name}_${gpu}.json" "$@" 2>&1 | tee "$out/stacks/${name}_${gpu}.log"
exit "${PIPESTATUS[0]}"
