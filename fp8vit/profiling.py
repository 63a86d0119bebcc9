"""Where does a training step's GPU time go? Kernel time per category, from the torch profiler.

    python -m fp8vit.profiling --model huge --batch-size 128 --precision fp8 --trace step.json

Categories are matched on kernel names (first match wins, in the order of ``CATEGORIES``);
``other`` collects the rest, and the table lists its largest kernels so the patterns can be
extended. Wall time per step is measured separately, so GPU-busy vs wall says whether the step
is GPU-bound or launch-bound.
"""

from __future__ import annotations

import argparse
import collections
import re
import time
from typing import Dict, Iterable, List, Tuple

import torch

__all__ = ["CATEGORIES", "categorize", "kernel_breakdown", "main"]

CATEGORIES: List[Tuple[str, str]] = [
    ("attention", r"flash|fmha|attn|attention|sdpa|cudnn_generated"),
    ("gemm", r"gemm|cutlass|xmma|nvjet|cublas|wgmma|sm90_|matmul|aten::(add|b)?mm$"),
    ("fp8 cast/transpose/amax", r"cast|transpose|amax|quantiz|fp8|scale"),
    ("layernorm", r"layer_?norm|rms_?norm|\bln_|_ln_"),
    ("optimizer", r"sgd|adam|multi_tensor|foreach|fused_.*optim"),
    ("elementwise/copy", r"elementwise|vectorized|unrolled|fill|copy|memcpy|memset|reduce|cat_|index"),
]
_COMPILED = [(name, re.compile(pat, re.IGNORECASE)) for name, pat in CATEGORIES]


def categorize(kernel_name: str) -> str:
    """The category of one kernel name (``"other"`` if no pattern matches)."""
    for name, pat in _COMPILED:
        if pat.search(kernel_name):
            return name
    return "other"


def kernel_breakdown(events: Iterable[Tuple[str, float]], steps: int) -> Dict[str, float]:
    """``(kernel name, microseconds)`` pairs -> milliseconds per step per category, plus ``total``."""
    out: Dict[str, float] = collections.defaultdict(float)
    for name, us in events:
        out[categorize(name)] += us / 1e3 / steps
    out["total"] = sum(out.values())
    return dict(out)


def main(argv=None) -> int:
    from torch.profiler import ProfilerActivity, profile

    from .workload import PRECISIONS, SIZES, build_model, make_optimizer, synthetic_batch, train_step_fn

    p = argparse.ArgumentParser(prog="python -m fp8vit.profiling", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="huge", help=f"{sorted(SIZES)} or a timm model name")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--precision", default="fp8", choices=PRECISIONS)
    p.add_argument("--recipe", default=None)
    p.add_argument("--steps", type=int, default=5, help="profiled steps (after --warmup)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--trace", default=None, help="write a Chrome trace here")
    a = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    wl = build_model(a.model, precision=a.precision, recipe=a.recipe, device=device)
    opt = make_optimizer(wl.model.parameters(), "sgd", lr=1e-3, device=device)
    step = train_step_fn(wl, opt)
    x, y = synthetic_batch(a.batch_size, wl, device=device)
    for _ in range(a.warmup):
        step(x, y)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step(x, y)
    sync()
    wall_ms = (time.perf_counter() - t0) * 1e3 / a.steps
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(a.steps):
            step(x, y)
        sync()
    if a.trace:
        prof.export_chrome_trace(a.trace)
    kind = "cuda" if device == "cuda" else "cpu"
    if kind == "cuda":  # GPU kernels, microseconds each
        events = [(e.name, e.device_time) for e in prof.events() if str(e.device_type).endswith("CUDA")]
    else:  # no kernels on CPU: aten ops' self time, so nothing is counted twice
        events = [(e.key, e.self_cpu_time_total) for e in prof.key_averages() if e.key.startswith("aten::")]
    br = kernel_breakdown(events, a.steps)
    print(f"{a.model} batch {a.batch_size} {a.precision}: wall {wall_ms:.1f} ms/step (unprofiled), "
          f"{'GPU kernel' if kind == 'cuda' else 'CPU op'} time {br['total']:.1f} ms/step")
    for cat in [c for c, _ in CATEGORIES] + ["other"]:
        if cat in br:
            print(f"  {cat:26s} {br[cat]:8.2f} ms  {100 * br[cat] / br['total']:5.1f}%")
    others = collections.Counter()
    for name, us in events:
        if categorize(name) == "other":
            others[name[:90]] += us / 1e3 / a.steps
    for name, ms in others.most_common(8):
        print(f"    other: {ms:7.2f} ms  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
