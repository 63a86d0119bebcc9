"""``fp8vit-bench``: fp8vit against what a user would pick instead, in one process and one run.

    fp8vit-bench --model huge --batch-size 128 --steps 30 --plot bench.png --json bench.json

Variants (``fp8vit.tools.workload``): timm bf16 eager and compiled, torchao float8 compiled, a
plain ``te.TransformerLayer`` (the raw-TE reference), fp8vit in bf16 and in FP8 per recipe, eager
and with the blocks CUDA-graphed. For each: median step time with its spread (p10-p90) over the
timed steps after warm-up, images/s, model TFLOP/s and the fraction of the GPU's dense bf16 peak,
peak memory, speedup against timm bf16 eager measured in the same run, and optionally cost per
million images. Ratios are only meaningful within one run (H200 step times drift ~5% between runs).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

import torch

from .. import _te
from ..detect import gpu_info
from .workload import (SIZES, VARIANTS, Variant, build_workload, make_optimizer, synthetic_batch, train_flops,
                       train_step_fn)

__all__ = ["main", "run_variant", "unavailable", "largest_fitting", "DENSE_BF16_PEAK"]

# Dense (no sparsity) bf16 tensor-core peak from the vendors' datasheets, FLOP/s, by name prefix.
DENSE_BF16_PEAK = {"H100": 989e12, "H200": 989e12, "H20": 148e12, "GH200": 989e12, "B200": 2250e12,
                   "L40S": 362e12, "L4": 121e12, "RTX 4090": 165e12}


def _peak(name: str) -> Optional[float]:
    for key in sorted(DENSE_BF16_PEAK, key=len, reverse=True):
        if key in name:
            return DENSE_BF16_PEAK[key]
    return None


def unavailable(variant: str, device: str) -> str:
    """Why ``variant`` cannot run here ("" if it can)."""
    v = Variant.parse(variant)
    if device != "cuda" and (v.compile or v.graphed or v.blocks == "te-layer" or v.fp8 is not None):
        return "needs a CUDA GPU"
    if v.te_fp8 and not gpu_info().recipes[v.fp8].ok:
        return gpu_info().recipes[v.fp8].reason
    te = _te.te_status()
    if v.blocks == "te-layer" and not te.ok:
        return te.reason
    if v.fp8 == "torchao":
        try:
            import torchao.float8  # noqa: F401
        except ImportError as err:
            return f"torchao is not installed ({err})"
    return ""


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def run_variant(variant: str, *, model: str, batch: int, steps: int, warmup: int, device: str,
                optimizer: str = "sgd", img_size: int = 224) -> Dict:
    """Build, warm up and time one variant. Returns its measurements (times in ms)."""
    torch.manual_seed(0)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    wl = build_workload(model, variant, batch_size=batch, img_size=img_size, device=device)
    # Bench learning rates are small and fixed: the step time, not the training, is measured.
    opt = make_optimizer(wl.model.parameters(), optimizer, lr=1e-3 if optimizer == "sgd" else 1e-4,
                         device=device)
    step = train_step_fn(wl, opt)
    x, y = synthetic_batch(batch, wl, device=device)
    t0 = time.perf_counter()
    for _ in range(warmup):
        loss = step(x, y)
    _sync(device)
    warm_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = step(x, y)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            loss = step(x, y)
            times.append((time.perf_counter() - t) * 1e3)
    q = statistics.quantiles(times, n=10) if len(times) >= 2 else [times[0]] * 9
    med = statistics.median(times)
    flops = train_flops(wl.model, batch, img_size)
    out = {"variant": variant, "batch": batch, "median_ms": med, "p10_ms": q[0], "p90_ms": q[-1],
           "min_ms": min(times), "max_ms": max(times), "images_per_s": batch / med * 1e3,
           "tflops": flops / (med * 1e-3) / 1e12, "loss": float(loss), "warmup_s": warm_s,
           "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None}
    if wl.graphs is not None:
        out["graph_replays"], out["graph_eager_calls"] = wl.graphs.replays, wl.graphs.eager_calls
        wl.graphs.release()
    del wl, opt, step, x, y
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def largest_fitting(fits, start: int, limit: int = 4096, granularity: int = 8) -> int:
    """Largest multiple of ``granularity`` <= ``limit`` for which ``fits(batch)`` is True.

    Doubles from ``start`` until a batch fails, then bisects; assumes ``fits`` is monotone.
    Returns 0 if even ``start`` does not fit.
    """
    lo, hi = 0, start
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + granularity)
    while hi - lo > granularity:
        mid = (lo + hi) // 2 // granularity * granularity
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def max_batch(variant: str, *, model: str, start: int, optimizer: str, img_size: int,
              limit: int = 4096, granularity: int = 8) -> int:
    """Largest batch (multiple of ``granularity``) for which two training steps fit in memory.

    Every probe runs in a new process (:func:`fits_in_fresh_process`).
    """
    return largest_fitting(lambda b: fits_in_fresh_process(
        variant, model=model, batch=b, optimizer=optimizer, img_size=img_size), start, limit, granularity)


def fits_in_fresh_process(variant: str, *, model: str, batch: int, optimizer: str, img_size: int) -> bool:
    """Whether two training steps (one warm-up, one timed) of ``variant`` at ``batch`` run, in a new process.

    A new process per probe because probes in one process are not independent: on the H200, after
    one CUDA-graphed ViT-H run at a batch, the same batch no longer fit in the same process, although
    torch reported its memory released (docs/performance.md, lever 14).

    Raises:
        RuntimeError: the probe failed for another reason than running out of memory (its message).
    """
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "probe.json")
        cmd = [sys.executable, "-m", "fp8vit.tools.bench", "--model", model, "--batch-size", str(batch),
               "--steps", "1", "--warmup", "1", "--variants", variant, "--optimizer", optimizer,
               "--img-size", str(img_size), "--json", path]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(path):
            raise RuntimeError(f"probe of {variant} at batch {batch} exited with {proc.returncode}: "
                               f"{' '.join(cmd)}\n{proc.stderr[-2000:]}")
        with open(path) as f:
            (row,) = json.load(f)["results"]
    if "median_ms" in row:
        return True
    if "OutOfMemoryError" in row["skipped"]:
        return False
    raise RuntimeError(f"probe of {variant} at batch {batch}: {row['skipped']}")


def _table(rows: List[Dict], peak: Optional[float], price: Optional[float]) -> str:
    base = next((r for r in rows if r["variant"] == "timm-bf16"), None)
    head = (f"{'variant':28s} {'median ms':>10s} {'p10-p90 ms':>15s} {'img/s':>8s} {'TFLOP/s':>8s} "
            f"{'% peak':>7s} {'mem GiB':>8s} {'vs timm':>8s}" + (f" {'$/1M img':>9s}" if price else ""))
    lines = [head, "-" * len(head)]
    for r in rows:
        if "skipped" in r:
            lines.append(f"{r['variant']:28s} skipped: {r['skipped']}")
            continue
        pct = f"{100 * r['tflops'] * 1e12 / peak:6.1f}%" if peak else "    n/a"
        mem = f"{r['peak_mem_gib']:8.1f}" if r["peak_mem_gib"] is not None else "     n/a"
        speed = f"{base['median_ms'] / r['median_ms']:7.2f}x" if base and "median_ms" in base else "     n/a"
        line = (f"{r['variant']:28s} {r['median_ms']:10.1f} {r['p10_ms']:7.1f}-{r['p90_ms']:<7.1f} "
                f"{r['images_per_s']:8.1f} {r['tflops']:8.1f} {pct} {mem} {speed}")
        if price:
            line += f" {price / 3600 / r['images_per_s'] * 1e6:9.2f}"
        lines.append(line)
    return "\n".join(lines)


def _plot(rows: List[Dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "median_ms" in r]
    base = next((r["median_ms"] for r in rows if r["variant"] == "timm-bf16"), None)
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(rows) + 1.5))
    names = [r["variant"] for r in rows][::-1]
    vals = [r["images_per_s"] for r in rows][::-1]
    colors = ["#d62728" if n.startswith("fp8vit-fp8") else ("#1f77b4" if n.startswith("fp8vit") else "#888888")
              for n in names]
    bars = ax.barh(names, vals, color=colors)
    for bar, r in zip(bars, rows[::-1]):
        label = f" {r['images_per_s']:.0f} img/s"
        if base:
            label += f"  ({base / r['median_ms']:.2f}x)"
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, label, va="center", fontsize=9)
    ax.set_xlabel("training throughput, images/s (higher is better)")
    ax.set_title(title, fontsize=10)
    ax.set_xlim(0, max(vals) * 1.35)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _environment(device: str) -> Dict:
    import timm

    env = {"torch": torch.__version__, "timm": timm.__version__, "python": sys.version.split()[0]}
    te = _te.te_status()
    env["transformer_engine"] = _te.te_version() if te.ok else f"unavailable: {te.reason}"
    info = gpu_info()
    env["device"] = info.name if device == "cuda" else "cpu"
    env["capability"] = info.capability
    return env


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="fp8vit-bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help=f"{sorted(SIZES)} or a timm model name "
                   "(default: huge on a GPU, micro on CPU)")
    p.add_argument("--batch-size", type=int, nargs="+", default=None,
                   help="one or more batch sizes (default: 128 on a GPU, 4 on CPU)")
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 30 GPU, 3 CPU)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 10 GPU, 1 CPU)")
    p.add_argument("--variants", nargs="+", default=None, choices=VARIANTS,
                   help="default: all that can run here")
    p.add_argument("--optimizer", default="sgd", choices=("sgd", "adamw"))
    p.add_argument("--price-per-hour", type=float, default=None, help="GPU price, for $ per 1M images")
    p.add_argument("--max-batch", action="store_true",
                   help="also find the largest batch that fits for timm-bf16 and the default FP8 recipe, "
                   "eager and graphed (each probe a new process: about 20 s each for ViT-H on an H200)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="write a bar chart (PNG) here")
    a = p.parse_args(argv)
    if a.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            p.error("--plot needs matplotlib: pip install 'fp8vit[plot]' (or matplotlib)")

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = a.model or ("huge" if device == "cuda" else "micro")
    batches = a.batch_size or ([128] if device == "cuda" else [4])
    steps = a.steps or (30 if device == "cuda" else 3)
    warmup = a.warmup if a.warmup is not None else (10 if device == "cuda" else 1)
    info = gpu_info()
    env = _environment(device)
    print(f"fp8vit-bench: {model}, batch {batches}, {steps} timed steps after {warmup} warm-up, "
          f"optimizer {a.optimizer}")
    print(" ".join(f"{k}={v}" for k, v in env.items()))
    variants = a.variants or list(VARIANTS)
    results = []
    for batch in batches:
        rows = []
        for v in variants:
            why = unavailable(v, device)
            if why:
                rows.append({"variant": v, "batch": batch, "skipped": why})
                continue
            try:
                r = run_variant(v, model=model, batch=batch, steps=steps, warmup=warmup, device=device,
                                optimizer=a.optimizer, img_size=a.img_size)
            except Exception as err:  # noqa: BLE001 - one broken variant is reported, the rest still run
                rows.append({"variant": v, "batch": batch, "skipped": f"failed: {type(err).__name__}: {err}"[:300]})
                print(f"  {v}: FAILED {type(err).__name__}: {err}", flush=True)
                gc.collect()
                if device == "cuda":
                    torch.cuda.empty_cache()
                continue
            rows.append(r)
            print(f"  {v}: {r['median_ms']:.1f} ms", flush=True)
        print(f"\n{model}, batch {batch}, {env['device']}:")
        print(_table(rows, _peak(env["device"]), a.price_per_hour))
        results.extend(rows)
    extra = {}
    if a.max_batch and device == "cuda":
        best = f"fp8vit-fp8-{info.default_recipe}" if info.fp8.ok else "fp8vit-bf16"
        for v in ("timm-bf16", best, f"{best}-graphed"):
            extra[v] = max_batch(v, model=model, start=batches[0], optimizer=a.optimizer, img_size=a.img_size)
            print(f"largest batch that fits, {v}: {extra[v]}", flush=True)
            if extra["timm-bf16"] and v != "timm-bf16":
                print(f"ratio {v} / timm-bf16: {extra[v] / extra['timm-bf16']:.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"environment": env, "model": model, "steps": steps, "warmup": warmup,
                       "optimizer": a.optimizer, "results": results, "max_batch": extra}, f, indent=2)
    if a.plot:
        first = [r for r in results if r["batch"] == batches[0]]
        _plot(first, a.plot, f"{model} training step, batch {batches[0]}, {env['device']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
