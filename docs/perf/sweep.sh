#!/usr/bin/env bash
# Issue 34's sweep: fp8vit-bench on 22 timm models (every fused family, hybrids, partly fused models,
# generic ones fp8vit does not fuse, and a CNN that holds nothing to convert), each against timm bf16
# eager and timm + torch.compile in the same process, so that docs/perf/sweep_table.py can say per model
# whether fp8vit's best variant is slower than torch.compile alone by more than 2%.
#
#   bash docs/perf/sweep.sh --list          # the models, batches, variants and time estimates; runs nothing
#   bash docs/perf/sweep.sh 1               # one group (1-8): each fits one device command (< 9 min)
#   bash docs/perf/sweep.sh swin_base_patch4_window7_224 ...   # some models of the table (a rerun)
#   python3 docs/perf/sweep_table.py        # then: the table of every bench/*_sweep_*.json
#
# Per model, one fp8vit-bench process: --steps 20 --warmup 8 (fewer than the bench's 30/10: the
# compiles dominate a run's time, not the steps) and the variants of its kind:
#   fused    timm-bf16, timm-bf16-compile, fp8vit-fp8-delayed-graphed (fp8vit fuses every block) and
#            fp8vit-fp8-delayed-graphed-compile (then torch.compile(model): stem and head compiled,
#            the graphed blocks outside dynamo)
#   hybrid   the same: for ViTamin, the R50 hybrid and PiT, -graphed-compile compiles the conv stems
#            (fallback="compile" compiles blocks holding Linears only: none there)
#   narrow   hybrid's, and fp8vit-fp8-delayed-bf16narrow-graphed-compile: FP8 off in blocks under 512
#            channels (CrossViT-15's branches are 192 and 384 wide: on an H100 its graphed-compile
#            step was 2.9% slower than timm + compile, a run whose log was lost)
#   generic  timm-bf16, timm-bf16-compile, fp8vit-fp8-delayed-compile (convert_to_te, then
#            torch.compile(model): everything but fused blocks compiled, what convert_to_te(compile=True)
#            does), with --interleave: all three built first, their steps timed in turn, as fp8vit's
#            variant, with nothing fused, is the very graph timm's compile ran, and one after the
#            other a drift read as a difference (H100: ResNet-50's 1.1% slower third; Hiera's timm
#            compile 50.3 ms, then 53.5 after fp8vit's variant, the same graph).
#            fallback="compile" (-blockcompile: per-block compiles) is left out: one more
#            compile per model (30-110 s each on the H200, by the estimates below) for a variant that
#            compiles less of the model than that one. fallback="linear" (FP8 Linears, eager:
#            0.90-1.00x timm eager, docs/performance.md) is left out too. CrossViT and PiT, partly
#            fused, run as hybrids: CrossViT's MultiScaleBlocks take a list of two branches' tokens,
#            so each branch (an nn.Sequential of blocks) is graphed; PiT's blocks sit in stages
#            (transformers.N.blocks), graphed per stage as Swin's (fused blocks left eager under
#            compile are host-bound: docs/performance.md). ResNet-50, the
#            control, holds nothing fp8vit converts: its fp8vit variant is timm + compile again.
# Logs and JSON under $OUT (default docs/results) by docs/perf/h200.sh's names, GPU last (te_env.sh's
# $gpu: h200, h100): bench/MODEL_bBATCH_sweep_h200.{log,json}; at the end, also the run's logs and JSONs
# in one tarball, sweep_N_h200.tgz under $OUT (N: the arguments joined by '_', the group's number for a group; paths
# inside as under $OUT: bench/...), as the device machine returns at most 8 files of $OUT and a group
# writes up to 10; nothing is removed. CrossViT runs at its own 240 px (--img-size 240; at 224
# its two branches' token counts do not match); every other model at 224 px.
#
# Batches: what gives timm's bf16 eager step roughly 30-200 ms on an H200 (ViT-B/16 b128 49 ms,
# ViT-L/16 b128 139, Swin-B b128 122, BEiT-B b128 65: docs/results/bench; ConvNeXt-B b128 93 ms, a run
# not kept there), scaled by each model's FLOPs. Memory is far from the H200's 141 GB: timm eager
# peaks at 9 GiB for ViT-B b128, 19 for Swin-B b128, 26 for EVA02-L b64, 42 for ViT-H b128
# (docs/results/bench); by their activations' sizes none here should pass about 40 GiB (an estimate).
#
# Time: the seconds per variant in the table are estimates (mine), not measurements: wall time of
# the model's build, its compile or graph capture, and its 48 steps (8 warm-up, 20 timed, 20
# pipelined), from the H200 runs of docs/results/bench where the model or a similar one ran, else from
# its FLOPs and block count; plus START_S per bench process. The compile times of the hierarchical
# models (Swin, MaxViT, DaViT, MViTv2, Hiera) are the least certain. A group stops starting models
# when what is left of SWEEP_BUDGET_S (default 540 s: under the device's 9.5-minute command limit,
# counted from the script's start) is less than the next model's estimate, and stops a model that
# runs past it (timeout): those models are reported, with the command that reruns them.
#
# A model's failure (a failed or skipped variant, a bench exit code, a timeout, no JSON) does not stop
# the group; the script exits 1 at the end if any model failed, after the group's table.
# TORCH_LOGS=recompiles (unless TORCH_LOGS is set): dynamo then logs each recompilation with the guard
# that failed, and only then (cheap); a compiled block past the recompile limit shows there.
set -o pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
START_S=8  # one bench process: python, torch, TE and timm imports, the model's shape on the meta device
GROUP_S=10  # once per invocation: te_env.sh's TE check, nvidia-smi

# group model batch img_size kind seconds-per-variant (estimates, in the kind's variant order)
SWEEP="
1 vit_base_patch16_224          128 224 fused     5  30   7  15
1 vit_large_patch16_224         128 224 fused    12  47  14  15
1 deit3_base_patch16_224        128 224 fused     5  30   7  15
1 eva02_base_patch14_224        128 224 fused     8  50   9  16
1 vit_base_patch16_rope_224     128 224 fused     8  44   9  15
5 vit_pe_core_base_patch16_224  128 224 fused     8  48   9  16
2 aimv2_large_patch14_224        64 224 fused    12  45  11  15
2 vitamin_base_224              128 224 hybrid   10  60  12  30
2 vit_base_r50_s16_224          128 224 hybrid    8  50  10  25
2 pit_b_224                     128 224 hybrid    6  35  10  35
8 resnet50                      256 224 generic   8  50   15
7 crossvit_15_240               256 240 narrow    8  60  12  40  40
3 beit_base_patch16_224         128 224 fused     6  40   8  16
3 swin_base_patch4_window7_224  128 224 fused    10 120  20  60
4 convnext_base                 128 224 fused     8  70  15  45
8 maxvit_tiny_tf_224            128 224 generic   8 110   20
5 cait_s24_224                  256 224 generic  17  90   15
5 xcit_small_12_p16_224         256 224 generic  10  90   15
7 davit_base                    128 224 generic  10  90   20
6 efficientformer_l3            256 224 generic  10 180   15
6 hiera_base_224                128 224 generic   7  85   15
4 mvitv2_small                  128 224 generic   7  80   20
"

variants_of() {  # kind -> comma-separated variants
  local base=timm-bf16,timm-bf16-compile
  case $1 in
    fused) echo "$base,fp8vit-fp8-delayed-graphed,fp8vit-fp8-delayed-graphed-compile" ;;
    hybrid) echo "$base,fp8vit-fp8-delayed-graphed,fp8vit-fp8-delayed-graphed-compile" ;;
    narrow) echo "$base,fp8vit-fp8-delayed-graphed,fp8vit-fp8-delayed-graphed-compile,fp8vit-fp8-delayed-bf16narrow-graphed-compile" ;;
    generic) echo "$base,fp8vit-fp8-delayed-compile" ;;
    *) echo "sweep.sh: unknown kind $1" >&2; return 2 ;;
  esac
}

estimate_of() {  # seconds per variant... -> the model's seconds (its bench process included)
  local s=$START_S v
  for v in "$@"; do s=$((s + v)); done
  echo "$s"
}

rows_of() {  # group numbers or model names -> their table rows, in table order
  local want=" $* " group model rest
  while read -r group model rest; do
    [ -n "$group" ] || continue
    [[ $want == *" $group "* || $want == *" $model "* ]] && echo "$group $model $rest"
  done <<< "$SWEEP"
}

list() {  # the whole table with estimates, one model a line; '#' lines: group totals
  local g total group model batch img kind est
  echo "# group model batch img_size est_s variants (est_s: an estimate, not a measurement)"
  for g in $(awk 'NF {print $1}' <<< "$SWEEP" | sort -un); do
    total=$GROUP_S
    while read -r group model batch img kind est; do
      est=$(estimate_of $est)
      total=$((total + est))
      echo "$group $model $batch $img $est $(variants_of "$kind")"
    done < <(rows_of "$g")
    echo "# group $g: about $total s, $((total / 60)) min $((total % 60)) s (an estimate)"
  done
}

case ${1:-} in
  --list) list; exit 0 ;;
  -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  "") sed -n '7,10p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
rows=$(rows_of "$@")
for arg in "$@"; do
  grep -qE "^$arg | $arg " <<< "$rows" ||
    { echo "sweep.sh: $arg is neither a group nor a model of the sweep (--list)"; exit 2; }
done

. "$here/te_env.sh"  # cd to the repository root; $out; TE
mkdir -p "$out/bench"
export TORCH_LOGS=${TORCH_LOGS-recompiles}
budget=${SWEEP_BUDGET_S:-540}
total=$GROUP_S
while read -r _ _ _ _ _ est; do total=$((total + $(estimate_of $est))); done <<< "$rows"
echo "sweep $*: $(wc -l <<< "$rows") models, about $((total / 60)) min $((total % 60)) s by my estimates" \
  "(per-variant H200 guesses, not measurements; --list shows them); time budget ${budget} s"
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader

failed=() rerun=() jsons=() packed=()  # packed: the run's files, relative to $out, for the tarball
while read -r group model batch img kind est; do
  est=$(estimate_of $est)
  variants=$(variants_of "$kind")
  name="$out/bench/${model}_b${batch}_sweep_$gpu"
  left=$((budget - SECONDS))
  echo
  echo "=== group $group: $model, batch $batch, ${img} px, $kind: ${variants//,/, }" \
    "(about $est s, estimate; ${left} s of budget left)"
  if [ "$budget" -gt 0 ] && [ "$left" -lt "$est" ]; then
    echo "not started: ${left} s left of the ${budget} s budget, the model's estimate is $est s"
    failed+=("$model: not started (time budget)"); rerun+=("$model"); continue
  fi
  limit=$([ "$budget" -gt 0 ] && echo "$left" || echo 0)  # timeout 0: no limit
  # The whole output goes to the log; the console gets the bench's progress lines, the table comes
  # at the end. An old JSON goes first: a run stopped now writes none, and the old one would pass.
  rm -f "$name.json"
  timeout -k 10 "$limit" python3 -m fp8vit.tools.bench --model "$model" --batch-size "$batch" --img-size "$img" \
    --steps 20 --warmup 8 --variants ${variants//,/ } $([ "$kind" = generic ] && echo --interleave) \
    --json "$name.json" < /dev/null > "$name.log" 2>&1
  rc=$?
  packed+=("bench/${name##*/}.log")
  [ -f "$name.json" ] && packed+=("bench/${name##*/}.json")
  grep -E '^\[[0-9]+/[0-9]+\]|^estimate' "$name.log" | cut -c1-220
  if [ ! -f "$name.json" ]; then  # the bench writes its JSON last: a stopped run has none
    if [ "$budget" -gt 0 ] && [ "$SECONDS" -ge "$budget" ] && { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; }; then
      why="stopped at the ${budget} s time budget (exit $rc)"
    else
      tail -20 "$name.log"
      why="fp8vit-bench exited $rc without JSON (tail of $name.log above)"
    fi
    echo "$model: $why"
    failed+=("$model: $why"); rerun+=("$model"); continue
  fi
  jsons+=("$name.json")
  # fp8vit-bench exits 0 when a variant fails (it reports it and runs the rest): read the JSON.
  bad=$(python3 -c 'import json, sys
rows = json.load(open(sys.argv[1]))["results"]
print("; ".join(r["variant"] + ": " + (r["skipped"].splitlines() or [""])[0][:160] for r in rows if "skipped" in r))' \
    "$name.json" < /dev/null)
  if [ -n "$bad" ] || [ "$rc" -ne 0 ]; then
    failed+=("$model: ${bad:-fp8vit-bench exited $rc}")
  fi
done <<< "$rows"

echo
if [ ${#jsons[@]} -gt 0 ]; then
  python3 "$here/sweep_table.py" "${jsons[@]}"
fi
echo
n=$(wc -l <<< "$rows")
echo "sweep $*: $((n - ${#failed[@]})) of $n models ran every variant, in ${SECONDS} s"
if [ ${#packed[@]} -gt 0 ]; then  # one file for the device's 8 returned: every log and JSON of the run
  tgz="$out/sweep_$(tr ' ' _ <<< "$*")_$gpu.tgz"
  tar -czf "$tgz" -C "$out" "${packed[@]}" && echo "logs and JSONs: $tgz (${#packed[@]} files)"
fi
if [ ${#failed[@]} -gt 0 ]; then
  printf 'FAILED %s\n' "${failed[@]}"
  [ ${#rerun[@]} -gt 0 ] && echo "rerun: bash docs/perf/sweep.sh ${rerun[*]}"
  exit 1
fi
