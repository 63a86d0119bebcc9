#!/usr/bin/env bash
# A lever's before and after in one device call, where no switch turns it off: fp8vit-bench from an
# earlier commit's fp8vit and from this tree's, in turn (before, after, before, after: a drift over
# the call falls on both), each process with its own timm-bf16 (its ratios are within itself). Both
# sides measure with this tree's fp8vit/tools (the bench, its workloads): only the library differs.
#
#   bash dev/ab_bench.sh prepare COMMIT               # here: COMMIT's fp8vit/ into .ab/COMMIT (git-ignored:
#                                                     #   run with carry [".kit", ".ab"])
#   bash dev/ab_bench.sh run COMMIT NAME ARGS...      # on the device: fp8vit-bench ARGS, 4 processes; logs
#                                                     #   $OUT/bench/NAME_{before,after}{1,2}_$gpu.{log,json}
#
# Example (lever 40): prepare 63447f8, then
#   bash dev/ab_bench.sh run 63447f8 vit_pe_core_large_patch14_336_b32_lever40 --model vit_pe_core_large_patch14_336 \
#     --batch-size 32 --variants timm-bf16 fp8vit-fp8-delayed-graphed
set -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
case $1 in
  prepare)
    rm -rf ".ab/$2" && mkdir -p ".ab/$2" && git archive "$2" fp8vit | tar -x -C ".ab/$2" || exit 1
    # the measuring code is this tree's on both sides (session 31: 63447f8's bench read its loss
    # before the pipelined steps and timed with its own loop; a bench change is not the lever)
    rm -rf ".ab/$2/fp8vit/tools" && cp -r fp8vit/tools ".ab/$2/fp8vit/tools" && find ".ab/$2" -name __pycache__ -prune -exec rm -rf {} + || exit 1
    echo "fp8vit of $2 in .ab/$2 ($(du -sh ".ab/$2" | cut -f1)); run with carry [\".kit\", \".ab\"]" ;;
  run)
    commit=$2 name=$3; shift 3
    [ -d ".ab/$commit/fp8vit" ] || { echo "no .ab/$commit/fp8vit: run 'bash dev/ab_bench.sh prepare $commit' here and carry .ab"; exit 2; }
    . docs/perf/te_env.sh  # TE, $out, $gpu; PYTHONPATH: this tree first
    mkdir -p "$out/bench"
    rc=0
    for round in $(seq "${AB_ROUNDS:-2}"); do
      for side in before after; do
        log="$(cd "$out" && pwd)/bench/${name}_${side}${round}_$gpu"
        # python puts the working directory first on sys.path: each side runs from its tree
        dir=$([ $side = before ] && echo ".ab/$commit" || echo .)
        echo "=== $side, round $round: $(cd "$dir" && python3 -c 'import fp8vit; print(fp8vit.__file__)')"
        (cd "$dir" && python3 -m fp8vit.tools.bench "$@" --json "$log.json") > "$log.log" 2>&1 || rc=1
        python3 - "$log.json" <<'EOF' || rc=1
import json, sys
d = json.load(open(sys.argv[1]))
base = {r["batch"]: r for r in d["results"] if r["variant"] == "timm-bf16" and "median_ms" in r}
for r in d["results"]:
    if "median_ms" not in r:
        print(f"  {r['variant']}: {r.get('skipped', 'no result')[:120]}")
        continue
    x = f" ({base[r['batch']]['median_ms'] / r['median_ms']:.3f}x)" if r["batch"] in base else ""
    print(f"  {r['variant']:40s} {r['median_ms']:7.2f} ms{x}, pipelined {r.get('pipelined_median_ms', float('nan')):7.2f}")
EOF
      done
    done
    exit $rc ;;
  *) sed -n 2,14p "$0"; exit 2 ;;
esac
