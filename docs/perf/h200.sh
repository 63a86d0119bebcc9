#!/usr/bin/env bash
# The H200 runs behind docs/results/: install TE from the kit (.kit, see ../shared/te-kit/README.md),
# then run the stages named on the command line, each writing its log to $OUT (default docs/results).
#
#   bash docs/perf/h200.sh tests:tests/gpu/test_eva_gpu.py     # one GPU test file (or several, comma-separated)
#   bash docs/perf/h200.sh tests                               # the whole GPU suite
#   bash docs/perf/h200.sh bench:eva02_base_patch14_224:128    # fp8vit-bench, default variants
#   bash docs/perf/h200.sh bench:eva02_base_patch14_224:128:timm-bf16,fp8vit-fp8-delayed-graphed
#   bash docs/perf/h200.sh profile:eva02_large_patch14_224:64:fp8vit-fp8-delayed-graphed   # fp8vit-profile
set -o pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-docs/results}
mkdir -p "$out"
if [ ! -f /tmp/te_env.sh ]; then
  bash .kit/setup.sh > "$out/te_setup.log" 2>&1 || { tail -30 "$out/te_setup.log"; exit 1; }
fi
. /tmp/te_env.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
rc=0
for stage in "$@"; do
  IFS=: read -r kind a b c <<< "$stage"
  case $kind in
    tests)
      files=${a:-tests}
      name=$(basename "${files%%,*}" .py)
      python3 -m pytest -m gpu -q -s -p no:cacheprovider ${files//,/ } 2>&1 | tee "$out/gpu_${name}.log" | tail -40 || rc=1 ;;
    bench)
      variants=${c:+--variants ${c//,/ }}
      python3 -m fp8vit.tools.bench --model "$a" --batch-size "${b:-128}" $variants \
        --json "$out/bench_${a}_${b:-128}.json" 2>&1 | tee "$out/bench_${a}_${b:-128}.log" || rc=1 ;;
    profile)
      name="profile_${a}_${b:-128}_${c:-fp8vit-fp8-delayed-graphed}"
      python3 -m fp8vit.tools.profiling --model "$a" --batch-size "${b:-128}" --variant "${c:-fp8vit-fp8-delayed-graphed}" \
        --kernels "$out/$name.kernels.txt" > "$out/$name.log" 2>&1 || rc=1
      grep -A12 "wall" "$out/$name.log" ;;
    *) echo "unknown stage $stage"; rc=2 ;;
  esac
done
exit $rc
