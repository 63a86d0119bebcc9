# Sourced by the scripts in docs/perf: Transformer Engine from the kit (.kit/setup.sh: a copy of the TE
# wheels and their installer; skip it where TE is installed), the repository on PYTHONPATH, and
# out=$OUT (default docs/results), where every script writes its logs under the names that
# docs/results/INDEX.md lists.
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
out=${OUT:-docs/results}
mkdir -p "$out"
# $gpu names the card in every log's name (h200, h100, ...): the first word of nvidia-smi's name after
# "NVIDIA", lowercased, so that a run lent an H100 is not filed as an H200 one.
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null |
  awk 'NR == 1 {for (i = 1; i <= NF; i++) if ($i != "NVIDIA") {print tolower($i); exit}}')
gpu=${gpu:-gpu}
# The kit's /tmp/te_env.sh first whenever it exists: it points TE at torch's cuDNN. A TE that imports
# without it (PYTHONPATH=/tmp/site on a machine where the kit ran before) loads another cuDNN and
# loses its fused attention (seen: Swin's and BEiT's attention unfused on a reused machine).
if [ -f /tmp/te_env.sh ]; then . /tmp/te_env.sh
elif python3 -c 'import transformer_engine.pytorch' 2>/dev/null; then :
elif bash .kit/setup.sh > /tmp/te_setup.log 2>&1; then . /tmp/te_env.sh
else tail -30 /tmp/te_setup.log; exit 1
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# One line in every log: which cuDNN torch and TE each run (a TE pointed at another cuDNN than the one
# it expects can lose its fused attention, and fp8vit then warns that attention runs unfused).
python3 -c 'import transformer_engine.pytorch as te, torch; print("cuDNN: torch", torch.backends.cudnn.version(), "| TE", te.get_cudnn_version())' 2>/dev/null | grep cuDNN || true
