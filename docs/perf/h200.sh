#!/usr/bin/env bash
# fp8vit's GPU runs (tests, fp8vit-bench, fp8vit-profile), each stage named on the command line writing
# its log under $OUT (default docs/results) by the names docs/results/INDEX.md lists, the GPU's name last
# (te_env.sh's $gpu: _h200 below on an H200, _h100 on an H100):
#
#   bash docs/perf/h200.sh tests                                   # the GPU suite: tests/gpu_suite_h200.log
#   bash docs/perf/h200.sh tests:tests/gpu/test_eva_gpu.py         # some files (comma-separated): tests/gpu_test_eva_gpu_h200.log
#   bash docs/perf/h200.sh bench:eva02_base_patch14_224:128        # default variants: bench/eva02_base_patch14_224_b128_default4_h200.{log,json}
#   bash docs/perf/h200.sh bench:MODEL:BATCH:V1,V2,...:TAG         # chosen variants: bench/MODEL_bBATCH_TAG_h200.{log,json}
#   bash docs/perf/h200.sh profile:MODEL:BATCH:VARIANT             # fp8vit-profile: profile/MODEL_bBATCH_VARIANT_h200.{log,kernels.txt}
#   bash docs/perf/h200.sh profile:MODEL:BATCH:VARIANT:sync        # its synchronized steps: profile/..._VARIANT_sync_h200.*
#   bash docs/perf/h200.sh timeline:MODEL:BATCH                    # dev/step_timeline.py: profile/MODEL_bBATCH_timeline_h200.log
#   bash docs/perf/h200.sh hostcosts:MODEL:BATCH                   # dev/host_costs.py: profile/MODEL_bBATCH_hostcosts_h200.log
# IMG_SIZE=336 (bench, profile, timeline, hostcosts): that image side, `_336px` after the batch in the names.
# BENCH_ARGS='--interleave' (bench): more fp8vit-bench arguments.
# POWER=1 (bench): nvidia-smi's power and SM clock every 200 ms beside it, summed up per variant by
# docs/perf/power_summary.py: levers/power_MODEL_bBATCH_..._$gpu.{log,marks.log}.
set -o pipefail
. "$(dirname "$0")/te_env.sh"
mkdir -p "$out/tests" "$out/bench" "$out/profile" "$out/levers"
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
rc=0
px=${IMG_SIZE:+_${IMG_SIZE}px}
img=${IMG_SIZE:+--img-size $IMG_SIZE}
for stage in "$@"; do
  IFS=: read -r kind a b c d <<< "$stage"
  case $kind in
    tests)
      files=${a:-tests/gpu}
      case $files in tests|tests/gpu|tests/gpu/) name=gpu_suite ;; *) name=gpu_$(basename "${files%%,*}" .py) ;; esac
      python3 -m pytest -m gpu -q -s -p no:cacheprovider ${files//,/ } 2>&1 | tee "$out/tests/${name}_$gpu.log" | tail -40 || rc=1 ;;
    bench)
      variants=${c:+--variants ${c//,/ }}
      name="bench/${a}_b${b:-128}${px}_${d:-${c:+custom}}"; name=${name%_}; [ -z "$c" ] && name="${name}_default4"
      power=$out/levers/power_${name#bench/}_$gpu
      if [ -n "${POWER:-}" ]; then
        nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm,temperature.gpu --format=csv -lms 200 > "$power.log" &
        smi=$!
      fi
      python3 -m fp8vit.tools.bench --model "$a" --batch-size "${b:-128}" $img $variants ${BENCH_ARGS:-} \
        --json "$out/${name}_$gpu.json" 2>&1 | tee "$out/${name}_$gpu.log" |
        if [ -n "${POWER:-}" ]; then while IFS= read -r l; do echo "$(date +%H:%M:%S.%2N) $l"; done > "$power.marks.log"; else cat; fi || rc=1
      if [ -n "${POWER:-}" ]; then
        kill $smi; tail -9 "$out/${name}_$gpu.log"; python3 "$(dirname "$0")/power_summary.py" "$power.log"
      fi ;;
    profile)
      # d = sync: synchronized steps (fp8vit-bench's median), 20 of them, where their time goes
      name="profile/${a}_b${b:-128}${px}_${c:-fp8vit-fp8-delayed-graphed}${d:+_$d}_$gpu"
      python3 -m fp8vit.tools.profiling --model "$a" --batch-size "${b:-128}" $img --variant "${c:-fp8vit-fp8-delayed-graphed}" \
        ${d:+--$d --steps 20} --kernels "$out/$name.kernels.txt" > "$out/$name.log" 2>&1 || rc=1
      grep -A12 "wall" "$out/$name.log" ;;
    timeline)
      # a synchronized graphed step's GPU idle per segment (host marks, CUDA events; no profiler)
      name="profile/${a}_b${b:-128}${px}_timeline_$gpu"
      python3 dev/step_timeline.py --model "$a" --batch-size "${b:-128}" $img > "$out/$name.log" 2>&1 || rc=1
      tail -40 "$out/$name.log" ;;
    hostcosts)
      # host time of fp8_context, autocast, TE's autocast and the graph dispatch; cProfile of the step
      name="profile/${a}_b${b:-128}${px}_hostcosts_$gpu"
      python3 dev/host_costs.py --model "$a" --batch-size "${b:-128}" $img > "$out/$name.log" 2>&1 || rc=1
      head -20 "$out/$name.log" ;;
    *) echo "unknown stage $stage"; rc=2 ;;
  esac
done
exit $rc
