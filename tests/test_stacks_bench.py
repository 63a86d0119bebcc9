"""docs/perf/stacks_bench.py on the CPU (``--device cpu``: a depth-2 ViT at 32 px, fp8vit's reference
modules): every stack runs its bf16 and fp8vit children and prints a RESULT line with finite step times
and a converted fp8vit model; a failing child is a FAILED row and a nonzero exit; timm-train's log
parsing and its bf16 script (timm's original train.py, rebuilt from the vendored one). ``--repeats``:
the interleaved rounds, the median of the per-run medians and their spread, the table at one repeat
as without the option, a failed repeat, the estimate (with stand-in children), and one real run."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import helpers
import pytest

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


def test_repeats_with_real_children_table_the_median_of_their_medians(tmp_path):
    res, report = bench(tmp_path, "--stacks", "plain", "--repeats", "2")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    runs = {v: [r for r in report["results"] if r["variant"] == v] for v in ("bf16", "fp8vit")}
    assert {v: [r["repeat"] for r in rs] for v, rs in runs.items()} == {"bf16": [1, 2], "fp8vit": [1, 2]}
    row = report["table"][0]
    for variant, name in (("bf16", "bf16"), ("fp8vit", "fp8")):
        walls = [r["median_ms_wall"] for r in runs[variant]]
        assert row[f"{name}_ms_wall"] == pytest.approx(sum(walls) / 2)  # the median of two runs
        assert row[f"{name}_runs_spread_pct_wall"] == pytest.approx(100 * abs(walls[0] - walls[1]) / (sum(walls) / 2))
        assert row[f"{name}_runs_spread_pct_events"] is None  # no CUDA events on the CPU
    assert "runs spread %" in res.stdout and "0 failed run(s) of 4" in res.stdout


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


# ---------------------------------------------------------------------------------------------- --repeats
# The parent's side only: run_child (and timm-train's run_timm_train) replaced by stand-ins that record
# the order of the runs and answer with the times a test gives, so the rounds, the median of the
# per-run medians, the spread and the failed repeats are checked without starting a child.

class FakeRuns:
    """Stand-in for ``run_child``: records each call and answers the RESULT a GPU child would print.

    Args:
        times: ``run key -> [events ms of repeat 1, 2, ...]``; other keys: 40 ms (bf16) and 24 ms
            (fp8vit) every repeat. The wall time is the events' +1%.
        fail: ``(run key, repeat) -> error``: that repeat raises ``ChildFailed(error)``; the error
            ``"unfused"`` instead returns an fp8vit RESULT with no fused block (check_evidence's case).
    """

    def __init__(self, sb, times: dict | None = None, fail: dict | None = None):
        self.sb, self.times, self.fail = sb, times or {}, fail or {}
        self.calls: list[tuple[str, str, str]] = []

    def __call__(self, key: tuple[str, str, str]) -> tuple[dict, str]:
        self.calls.append(key)
        repeat = self.calls.count(key)
        stack, model, variant = key
        error = self.fail.get((key, repeat))
        if error is not None and error != "unfused":
            raise self.sb.ChildFailed(error, f"Traceback (most recent call last):\n{error}")
        ms = self.times.get(key, [40.0 if variant == "bf16" else 24.0] * 9)[repeat - 1]
        res = {"stack": stack, "model": model, "variant": variant, "device": "cuda", "steps": 30,
               "median_ms_wall": 1.01 * ms, "median_ms_events": ms, "disagreement_pct": 1.0,
               "fused": 0 if variant == "bf16" or error == "unfused" else 12, "fp8_calls": 40, "block_calls": 40,
               "peak_mem_gib": 10.0,
               "graphs": {"shapes": [[128, 197, 768]], "replays": 38, "eager_calls": 1} if variant == "fp8vit" else None}
        if stack == "timm-train":  # train.py's log: no events, a loader wait
            res.update(median_ms_wall=ms, median_ms_events=None, disagreement_pct=None, median_ms_data=0.5,
                       bound="GPU", fp8_off_warning=False, graphs=None)
        return res, ""


def fake_bench(monkeypatch, capsys, tmp_path, fake: FakeRuns, *args: str, stacks: str = "plain,lightning",
               models: str = "vit_a"):
    """``main`` with the stand-in children: (exit code, stdout, the --json report)."""
    sb = fake.sb
    monkeypatch.setattr(sb, "run_child", lambda key, a: fake(key))
    monkeypatch.setattr(sb, "run_timm_train", lambda cfg, *rest: fake((cfg.stack, cfg.model, cfg.variant)))
    out = tmp_path / "out.json"
    rc = sb.main(["--device", "cpu", "--models", models, "--stacks", stacks, "--timm-data", str(tmp_path),
                  "--json", str(out), *args])
    return rc, capsys.readouterr().out, json.loads(out.read_text())


def row_of(report: dict, model: str, stack: str) -> dict:
    return next(r for r in report["table"] if r["model"] == model and r["stack"] == stack)


def test_repeats_run_the_plan_in_interleaved_rounds(monkeypatch, capsys, tmp_path):
    sb = load_script()
    fake = FakeRuns(sb)
    rc, out, report = fake_bench(monkeypatch, capsys, tmp_path, fake, "--repeats", "3", models="vit_a,vit_b",
                                 stacks="plain,lightning,lightning-plugin,timm-train")
    assert rc == 0, out
    # one round: every key once, in plan order (lightning-plugin's bf16 is lightning's: not run again),
    # timm-train's runs last as without repeats
    one_round = [(s, m, v) for m in ("vit_a", "vit_b") for s, v in (
        ("plain", "bf16"), ("plain", "fp8vit"), ("lightning", "bf16"), ("lightning", "fp8vit"),
        ("lightning-plugin", "fp8vit"))] + [("timm-train", m, v) for m in ("vit_a", "vit_b")
                                           for v in ("bf16", "fp8vit")]
    assert fake.calls == one_round * 3
    assert [r["repeat"] for r in report["results"] if r["stack"] == "plain" and r["model"] == "vit_b"
            and r["variant"] == "bf16"] == [1, 2, 3]
    assert f"[{len(one_round) + 1}/{3 * len(one_round)}] plain vit_a bf16 (repeat 2/3):" in out
    assert "0 failed run(s) of 42" in out


def test_repeats_table_the_median_of_the_run_medians_and_their_spread(monkeypatch, capsys, tmp_path):
    sb = load_script()
    times = {("plain", "vit_a", "bf16"): [40.0, 48.0, 42.0],  # median 42, spread 8/42
             ("plain", "vit_a", "fp8vit"): [21.0, 20.0, 24.0],  # median 21, spread 4/21
             ("lightning", "vit_a", "fp8vit"): [22.0, 25.0, 23.0],  # median 23: a gap smaller than the spreads
             ("timm-train", "vit_a", "bf16"): [60.0, 50.0, 55.0]}
    rc, out, report = fake_bench(monkeypatch, capsys, tmp_path, FakeRuns(sb, times), "--repeats", "3",
                                 stacks="plain,lightning,timm-train")
    assert rc == 0, out
    plain = row_of(report, "vit_a", "plain")
    assert plain["bf16_ms_events"] == pytest.approx(42.0) and plain["fp8_ms_events"] == pytest.approx(21.0)
    assert plain["bf16_ms_wall"] == pytest.approx(1.01 * 42.0)  # the wall's own median of medians
    assert plain["ratio_events"] == pytest.approx(2.0)
    assert plain["bf16_runs_spread_pct_events"] == pytest.approx(100 * 8 / 42)
    assert plain["fp8_runs_spread_pct_events"] == pytest.approx(100 * 4 / 21)
    assert plain["repeats_ok"] == {"bf16": 3, "fp8vit": 3}
    light = row_of(report, "vit_a", "lightning")
    assert light["vs_plain_events"] == pytest.approx((40 / 23) / 2.0)
    timm = row_of(report, "vit_a", "timm-train")
    assert timm["bf16_ms_wall"] == pytest.approx(55.0) and timm["bf16_ms_events"] is None
    assert timm["bf16_runs_spread_pct_wall"] == pytest.approx(100 * 10 / 55)
    lines = out.splitlines()
    head = next(line for line in lines if line.startswith("model "))
    assert "runs spread %" in head
    plain_line = next(line for line in lines if line.startswith("vit_a") and " plain " in line)
    assert "42.4 / 42.0" in plain_line and "21.2 / 21.0" in plain_line and "19.0 / 19.0" in plain_line
    timm_line = next(line for line in lines if line.startswith("vit_a") and " timm-train " in line)
    assert "18.2 / 0.0" in timm_line  # no events: the spread of the wall medians
    # the JSON keeps every run: the per-run medians per key, in round order
    entry = next(e for e in report["repeats"] if (e["stack"], e["variant"]) == ("plain", "bf16"))
    assert entry["run_ms_events"] == [40.0, 48.0, 42.0] and entry["ok"] == [1, 2, 3] and entry["failed"] == []
    assert len(report["results"]) == 3 * 6


def test_one_repeat_prints_the_table_as_without_the_option(monkeypatch, capsys, tmp_path):
    sb = load_script()
    fakes = [FakeRuns(sb), FakeRuns(sb)]
    rc, plain_out, plain_report = fake_bench(monkeypatch, capsys, tmp_path, fakes[0])
    rc1, out, report = fake_bench(monkeypatch, capsys, tmp_path, fakes[1], "--repeats", "1")
    assert rc == rc1 == 0
    assert out == plain_out and report["table"] == plain_report["table"]
    assert fakes[1].calls == [("plain", "vit_a", "bf16"), ("plain", "vit_a", "fp8vit"), ("lightning", "vit_a", "bf16"),
                              ("lightning", "vit_a", "fp8vit")]
    # the table's format as before --repeats existed: no spread column, no repeat tags
    assert "spread" not in out and "repeat" not in out
    lines = out.splitlines()
    assert ("model                  stack                    bf16 ms       fp8vit ms        speed-up        "
            "vs plain  note") in lines
    assert ("vit_a                  plain                40.4 / 40.0     24.2 / 24.0   1.667 / 1.667   "
            "1.000 / 1.000  ") in lines
    assert "[2/4] plain vit_a fp8vit: 24.2 ms wall, 24.0 ms events (+1.0%), 30 steps, fused 12, FP8 calls 40/40, " \
           "peak 10.0 GiB, graphs [[128, 197, 768]] replays 38 eager 1 (0 s)" in lines
    assert set(report["table"][0]) == {"model", "stack", "failed", "bf16_ms_wall", "bf16_ms_events", "fp8_ms_wall",
                                       "fp8_ms_events", "ratio_wall", "ratio_events", "vs_plain_wall",
                                       "vs_plain_events", "note"}
    assert "0 failed run(s)\n" in out


def test_a_failed_repeat_is_reported_and_the_others_are_used(monkeypatch, capsys, tmp_path):
    sb = load_script()
    times = {("plain", "vit_a", "fp8vit"): [20.0, 99.0, 22.0]}  # repeat 2 fails: median of 20 and 22
    fail = {(("plain", "vit_a", "fp8vit"), 2): "RuntimeError: CUDA error: flaky",
            (("lightning", "vit_a", "fp8vit"), 3): "unfused",  # a repeat without FP8 does not count either
            **{(("lightning", "vit_b", "bf16"), r): "ValueError: broken" for r in (1, 2, 3)}}
    rc, out, report = fake_bench(monkeypatch, capsys, tmp_path, FakeRuns(sb, times, fail), "--repeats", "3",
                                 models="vit_a,vit_b")
    assert rc == 1  # a failed repeat is a failed run
    plain = row_of(report, "vit_a", "plain")
    assert plain["failed"] is None and plain["fp8_ms_events"] == pytest.approx(21.0)
    assert plain["repeats_ok"] == {"bf16": 3, "fp8vit": 2}
    assert plain["failed_repeats"] == ["fp8vit: RuntimeError: CUDA error: flaky (repeat 2 of 3)"]
    assert "failed fp8vit: RuntimeError: CUDA error: flaky (repeat 2 of 3)" in plain["note"]
    light = row_of(report, "vit_a", "lightning")
    assert light["failed"] is None and "no fused block" in light["note"] and "(repeat 3 of 3)" in light["note"]
    broken = row_of(report, "vit_b", "lightning")  # no repeat of its bf16 succeeded: a FAILED row
    assert broken["failed"] == ["bf16: ValueError: broken (repeats 1,2,3 of 3)"]
    assert "FAILED  bf16: ValueError: broken (repeats 1,2,3 of 3)" in out
    assert "plain vit_a fp8vit (repeat 2/3): FAILED after 0 s: RuntimeError: CUDA error: flaky" in out
    assert "5 failed run(s) of 24" in out
    assert {(f["stack"], f["model"], f["variant"], f["repeat"]) for f in report["failures"]} == {
        ("plain", "vit_a", "fp8vit", 2), ("lightning", "vit_a", "fp8vit", 3),
        *(("lightning", "vit_b", "bf16", r) for r in (1, 2, 3))}
    entry = next(e for e in report["repeats"] if (e["stack"], e["model"], e["variant"]) == ("plain", "vit_a", "fp8vit"))
    assert entry["ok"] == [1, 3] and entry["run_ms_events"] == [20.0, 22.0]
    assert entry["failed"] == [{"repeat": 2, "error": "RuntimeError: CUDA error: flaky"}]
    gone = next(e for e in report["repeats"] if (e["model"], e["stack"], e["variant"]) == ("vit_b", "lightning", "bf16"))
    assert gone["ok"] == [] and len(gone["failed"]) == 3 and "median_ms_events" not in gone


def test_the_estimate_counts_every_repeat_and_the_image_folder_once(monkeypatch):
    import argparse

    sb = load_script()
    monkeypatch.setattr(sb, "step_priors", lambda model, batch: (50.0, 30.0))
    monkeypatch.setattr(sb, "meta_model", lambda model: (1e9, 86_000_000))

    def est(stacks, repeats):
        a = argparse.Namespace(device="cuda", batch_size=128, steps=30, warmup=10, repeats=repeats)
        return sb.estimate_s(["vit_a"], stacks, a)

    runs = ["plain", "lightning", "lightning-plugin"]
    assert est(runs, 3) == pytest.approx(3 * est(runs, 1)) and est(runs, 1) > 0
    with_timm = [*runs, "timm-train"]
    once = est(with_timm, 2) - est(with_timm, 1)  # one more round of runs
    assert est(with_timm, 3) == pytest.approx(est(with_timm, 1) + 2 * once)
    assert est(with_timm, 1) > once  # the JPEGs are written once, not per round


def test_repeats_must_be_positive():
    with pytest.raises(SystemExit):
        load_script().main(["--device", "cpu", "--repeats", "0"])
