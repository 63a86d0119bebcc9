"""docs/perf/stacks_bench.py on the CPU (``--device cpu``: a depth-2 ViT at 32 px, fp8vit's reference
modules): every stack runs its bf16 and fp8vit children and prints a RESULT line with finite step times
and a converted fp8vit model; a failing child is a FAILED row and a nonzero exit; timm-train's log
parsing and its bf16 script (timm's original train.py, rebuilt from the vendored one)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import helpers

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "docs" / "perf" / "stacks_bench.py"
HAVE = {name: importlib.util.find_spec(name) is not None for name in ("lightning", "accelerate")}
STACKS = ["plain"] + [s for s, need in (("lightning", "lightning"), ("lightning-plugin", "lightning"),
                                        ("accelerate", "accelerate")) if HAVE[need]]


def load_script():
    return helpers.load_script(SCRIPT, "stacks_bench")


def bench(tmp_path: Path, *args: str):
    out = tmp_path / "out.json"
    res = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--steps", "2", "--warmup", "1",
                          "--json", str(out), *args], check=False, capture_output=True, text=True, timeout=240,
                         cwd=ROOT)
    return res, json.loads(out.read_text())


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    return bench(tmp_path_factory.mktemp("stacks"), "--stacks", ",".join(STACKS))


@pytest.mark.parametrize("stack", ["plain", "lightning", "lightning-plugin", "accelerate"])
def test_each_stack_measures_bf16_and_a_converted_fp8vit_model(cpu_run, stack):
    need = "accelerate" if stack == "accelerate" else "lightning"
    if stack != "plain" and not HAVE[need]:
        pytest.skip(f"{need} is not installed (pip install '.[{need}]')")
    res, report = cpu_run
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    runs = {r["variant"]: r for r in report["results"]
            if r["stack"] == ("lightning" if stack == "lightning-plugin" and r["variant"] == "bf16" else stack)}
    if stack == "lightning-plugin":  # its bf16 baseline is lightning's; its own run is the fp8vit one
        runs["fp8vit"] = next(r for r in report["results"] if r["stack"] == stack)
    assert set(runs) == {"bf16", "fp8vit"}
    for r in runs.values():
        assert r["steps"] == 2 and r["device"] == "cpu"
        assert math.isfinite(r["median_ms_wall"]) and r["median_ms_wall"] > 0
        assert math.isfinite(r["in_step_ms"]) and 0 < r["in_step_ms"] <= r["median_ms_wall"] * 1.5
        assert r["median_ms_events"] is None  # no CUDA events on the CPU
        assert math.isfinite(r["loss_last"])
        assert r["block_calls"] == 3 and r["autocast"] == ["torch.bfloat16"]  # every step under the stack's bf16
        assert r["graphs"] is None  # CUDA graphs only on a GPU
    assert runs["bf16"]["fused"] == 0
    assert runs["fp8vit"]["fused"] == 2  # both blocks converted
    if stack in ("plain", "lightning"):
        assert runs["fp8vit"]["fp8_forward"]  # convert_to_te(autocast=True): the model carries FP8
    if stack == "accelerate":
        assert runs["fp8vit"]["fp8_forward_before_prepare"]
    if stack.startswith("lightning"):
        assert runs["fp8vit"]["device_at_configure_model"] == runs["fp8vit"]["device_at_fit_start"] == "cpu"
    row = next(r for r in report["table"] if r["stack"] == stack)
    assert row["failed"] is None and row["ratio_wall"] > 0
    assert row["vs_plain_wall"] == pytest.approx(row["ratio_wall"] / report["table"][0]["ratio_wall"])
    assert f"{stack} " in res.stdout and "0 failed run(s)" in res.stdout


def test_a_failing_child_is_a_failed_row_and_a_nonzero_exit(tmp_path):
    res, report = bench(tmp_path, "--stacks", "plain", "--models", "no_such_model")
    assert res.returncode == 1
    assert report["results"] == []
    assert {(f["stack"], f["variant"]) for f in report["failures"]} == {("plain", "bf16"), ("plain", "fp8vit")}
    assert all("no_such_model" in f["error"] for f in report["failures"])  # timm's "Unknown model" error
    assert report["table"][0]["failed"]
    assert "FAILED" in res.stdout and "2 failed run(s)" in res.stdout


def test_timm_train_log_parsing_skips_warmup_and_the_spare_last_step():
    sb = load_script()
    line = ("Train: 0 [{i:>4d}/6 ( 50%)]  Loss: 6.91 (6.91)  Time: {t:.3f}s,  100.00/s  (0.100s,  100.00/s)  "
            "LR: 1.000e-03  Data: {d:.3f} (0.001)")
    steps = [(0, 0.9, 0.5), (1, 0.050, 0.001), (2, 0.040, 0.001), (3, 0.042, 0.010), (4, 0.041, 0.001),
             (5, 0.5, 0.4)]
    log = "\n".join(["noise"] + [line.format(i=i, t=t, d=d) for i, t, d in steps])
    res = sb.parse_timm_log(log, warmup=2, steps=3)
    assert res["steps"] == 3
    assert res["median_ms_wall"] == pytest.approx(41.0) and res["median_ms_data"] == pytest.approx(1.0)
    assert res["bound"] == "GPU"
    with pytest.raises(RuntimeError, match="no 'Train"):
        sb.parse_timm_log("nothing here", warmup=0, steps=1)


def test_the_timm_train_baseline_is_timms_original_script():
    original = load_script().timm_original_train_py()
    assert "fp8vit" not in original
    vendored = (ROOT / "examples" / "timm_train" / "train.py").read_text()
    recorded = vendored.split("sha256 of the original file\n# ")[1][:64]
    assert hashlib.sha256(original.encode()).hexdigest() == recorded
