# Sourced by the scripts in docs/perf: Transformer Engine from the kit (.kit/setup.sh: a copy of the TE
# wheels and their installer; skip it where TE is installed), the repository on PYTHONPATH, and
# out=$OUT (default docs/results), where every script writes its logs under the names that
# docs/results/INDEX.md lists.
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
out=${OUT:-docs/results}
mkdir -p "$out"
if python3 -c 'import transformer_engine.pytorch' 2>/dev/null; then :
elif [ -f /tmp/te_env.sh ] || bash .kit/setup.sh > /tmp/te_setup.log 2>&1; then . /tmp/te_env.sh
else tail -30 /tmp/te_setup.log; exit 1
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# One line in every log: which cuDNN torch and TE each run (a TE pointed at another cuDNN than the one
# it expects can lose its fused attention, and fp8vit then warns that attention runs unfused).
python3 -c 'import transformer_engine.pytorch as te, torch; print("cuDNN: torch", torch.backends.cudnn.version(), "| TE", te.get_cudnn_version())' 2>/dev/null | grep cuDNN || true
