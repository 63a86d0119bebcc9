"""``fp8vit-profile``: where does a training step's GPU time go? Per kernel and per category.

    fp8vit-profile --model huge --batch-size 128 --variant fp8vit-fp8-delayed --kernels k.txt

Kernel times come from the torch profiler over ``--steps`` steps after ``--warmup``. Each kernel
is also attributed to the framework op that launched it (``--kernels`` lists the op path, e.g.
``FusedAttnFuncBackward > aten::zeros > aten::fill_``), which says where an unexpected kernel
comes from. Categories are matched on kernel names (first match wins, in the order of
``CATEGORIES``); ``other`` collects the rest. Wall time per step is measured separately, so
GPU-busy vs wall says whether the step is GPU-bound or launch-bound; each of the longest GPU-idle
gaps is listed with what the host ran meanwhile (its outermost ops, ``fp8vit::graphed_blocks``
for the CUDA-graph dispatch, and the time between ops: Python). Bytes moved per kernel need
hardware counters: ``--ncu-step`` brackets one step with ``cudaProfilerStart/Stop`` for
``ncu --profile-from-start off`` (see docs/performance.md).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import tempfile
from typing import Dict, Iterable, List, Tuple

import torch

from .bench import unavailable
from .cli import IMAGE_SIDE, at_least
from .timing import Stopwatch, median_ms
from .workload import SIZES, VARIANTS, build_workload, make_optimizer, synthetic_batch, train_step_fn

__all__ = ["CATEGORIES", "categorize", "idle_gaps", "host_during", "kernel_breakdown", "kernel_table", "trace_events",
           "trace_kernels", "trace_host_ops", "step_windows", "step_exposure", "STEP_RANGE", "main"]

CATEGORIES: List[Tuple[str, str]] = [
    # first: cuDNN names its LayerNorm kernels "cudnn_generated_layer_norm_*", which the attention
    # pattern's "cudnn_generated" would take (ViT-H's LayerNorm backward was counted as attention)
    ("layernorm (+fp8 cast)", r"layer_?norm|rms_?norm|\bln_|_ln_"),
    ("attention", r"flash|fmha|attn|attention|sdpa|cudnn_generated|cudnn::fusion"),
    ("gemm", r"gemm|cutlass|xmma|nvjet|cublas|wgmma|sm90_|matmul|aten::(add|b)?mm$"),
    # TE fuses the FP8 cast of a GEMM input into the norm or activation before it.
    ("activation (+fp8 cast)", r"gelu|relu|silu|unary_kernel"),
    # (?<!no): torch's strided copy kernels are called "gpu_kernel_impl_nocast<direct_copy...>".
    ("fp8 cast/transpose/amax", r"(?<!no)cast|transpose|amax|quantiz|fp8|scale|dbias"),
    ("optimizer", r"sgd|adam|multi_tensor|foreach|fused_.*optim"),
    ("elementwise/copy", r"elementwise|vectorized|unrolled|fill|copy|memcpy|memset|reduce|cat_|index|triton_"),
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


def kernel_table(launches: Iterable[Tuple[str, str, float]], steps: int) -> List[Tuple[str, str, float, float]]:
    """``(kernel, launching op path, microseconds)`` per launch -> rows
    ``(kernel, op path, calls per step, ms per step)``, longest first."""
    acc: Dict[Tuple[str, str], List[float]] = collections.defaultdict(lambda: [0, 0.0])
    for kernel, path, us in launches:
        acc[(kernel, path)][0] += 1
        acc[(kernel, path)][1] += us
    rows = [(k, p, n / steps, us / 1e3 / steps) for (k, p), (n, us) in acc.items()]
    return sorted(rows, key=lambda r: -r[3])


def idle_gaps(kernels: Iterable[Tuple[str, float, float]]) -> Tuple[float, float, List[Tuple[float, str, str, float]]]:
    """Where the GPU waits: ``(name, start_us, duration_us)`` per kernel (any order, overlapping
    kernels allowed) -> ``(busy_us, span_us, gaps)``, where ``gaps`` are ``(idle_us, kernel before,
    kernel after, gap start_us)``, longest first. Idle time inside a CUDA-graphed step is time the
    host spends issuing the eager parts (or waiting on a sync) while the GPU has nothing queued."""
    ks = sorted(kernels, key=lambda k: k[1])
    if not ks:
        return 0.0, 0.0, []
    busy, gaps = 0.0, []
    cur_start, cur_end, cur_last = ks[0][1], ks[0][1] + ks[0][2], ks[0][0]
    for name, start, dur in ks[1:]:
        if start > cur_end:  # a gap: close the current busy interval
            busy += cur_end - cur_start
            gaps.append((start - cur_end, cur_last, name, cur_end))
            cur_start, cur_end, cur_last = start, start + dur, name
        elif start + dur >= cur_end:
            cur_end, cur_last = start + dur, name
    busy += cur_end - cur_start
    return busy, cur_end - ks[0][1], sorted(gaps, key=lambda g: -g[0])


STEP_RANGE = "fp8vit::synchronized_step"  # --sync: the host range around each profiled step and its sync


def step_windows(events: list, name: str = STEP_RANGE) -> List[Tuple[float, float]]:
    """``(start_us, end_us)`` of each host range ``name`` among a trace's :func:`trace_events`:
    with ``--sync``, one per profiled step, from its first Python line to its sync's return."""
    return sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in events
                  if e.get("cat") == "user_annotation" and e.get("name") == name)


def step_exposure(kernels: Iterable[Tuple[str, float, float]], windows: List[Tuple[float, float]]
                  ) -> Tuple[Dict[str, float], List[Tuple[float, str, str, float]]]:
    """Where a synchronized step's time goes (what ``fp8vit-bench`` times as its median): per
    window of :func:`step_windows` (us, averaged over the windows with kernels), ``step`` (the
    window), ``busy`` (GPU), ``lead`` (before the first kernel: the host issuing the step's first
    work on an idle GPU), ``gaps`` (idle between kernels: the host behind the GPU) and ``tail``
    (after the last kernel: the sync's return); with every window's gaps, longest first, as
    :func:`idle_gaps` gives them."""
    ks = sorted(kernels, key=lambda k: k[1])
    total = dict.fromkeys(("step", "busy", "lead", "gaps", "tail"), 0.0)
    gaps, n = [], 0
    for w0, w1 in windows:
        inside = [k for k in ks if w0 <= k[1] < w1]
        if not inside:
            continue
        busy, span, g = idle_gaps(inside)
        first, last = inside[0][1], max(k[1] + k[2] for k in inside)
        for key, us in (("step", w1 - w0), ("busy", busy), ("lead", first - w0), ("gaps", span - busy),
                        ("tail", max(w1 - last, 0.0))):
            total[key] += us
        gaps += g
        n += 1
    return {k: v / max(n, 1) for k, v in total.items()}, sorted(gaps, key=lambda x: -x[0])


def trace_events(prof) -> list:
    """The complete (``"ph": "X"``) events of a profile's Chrome trace: what :func:`trace_kernels`
    and :func:`trace_host_ops` read (the profiler's Python events carry no GPU start times, and they
    tie a CUDA graph's kernels to the op around each replay more than once; the trace has each
    kernel once)."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        os.unlink(path)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X"]


def trace_kernels(events: list) -> List[Tuple[str, float, float]]:
    """``(name, start_us, duration_us)`` of every GPU kernel, memcpy and memset among a trace's
    :func:`trace_events`."""
    return [(e["name"], float(e["ts"]), float(e.get("dur", 0.0))) for e in events
            if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]


def trace_host_ops(events: list) -> List[Tuple[str, float, float]]:
    """``(name, start_us, duration_us)`` of the host's outermost ops among a trace's
    :func:`trace_events`: framework ops and ``record_function`` ranges (fp8vit's
    ``fp8vit::graphed_blocks``) not inside another, per thread, on the kernels' clock."""
    by_thread = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation"):
            by_thread[(e.get("pid"), e.get("tid"))].append((e["name"], float(e["ts"]), float(e.get("dur", 0.0))))
    out = []
    for ops in by_thread.values():
        end = float("-inf")
        for name, start, dur in sorted(ops, key=lambda o: (o[1], -o[2])):  # outer before inner
            if start >= end:
                out.append((name, start, dur))
                end = start + dur
    return sorted(out, key=lambda o: o[1])


def host_during(ops: Iterable[Tuple[str, float, float]], start: float, end: float,
                top: int = 3) -> List[Tuple[str, float]]:
    """What the host ran in ``[start, end)`` (us): the ``top`` outermost ops by time inside the
    window, ``(name, us)``, then ``("(between ops)", us)``: host time in none of them (Python)."""
    inside = collections.Counter()
    for name, s, d in ops:
        overlap = min(s + d, end) - max(s, start)
        if overlap > 0:
            inside[name] += overlap
    covered = sum(inside.values())
    return inside.most_common(top) + [("(between ops)", max(end - start - covered, 0.0))]


def _op_path(evt, depth: int = 4) -> str:
    """The chain of framework ops that launched a kernel, outermost of the last ``depth`` first."""
    names = []
    while evt is not None and len(names) < depth:
        names.append(evt.name)
        evt = evt.cpu_parent
    return " > ".join(reversed(names))


def _launches(prof) -> List[Tuple[str, str, float]]:
    out = []
    for evt in prof.events():
        for k in getattr(evt, "kernels", []) or []:
            out.append((k.name, _op_path(evt), k.duration))
    return out


def main(argv=None) -> int:
    from torch.profiler import ProfilerActivity, profile

    p = argparse.ArgumentParser(prog="fp8vit-profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="huge", help=f"{sorted(SIZES)} or a timm model name")
    p.add_argument("--batch-size", type=at_least(1, "images per step"), default=128)
    p.add_argument("--img-size", type=IMAGE_SIDE, default=224, help="image side in pixels (as fp8vit-bench's)")
    p.add_argument("--variant", default="fp8vit-fp8-delayed", choices=VARIANTS)
    p.add_argument("--steps", type=at_least(1, "profiled steps"), default=5, help="profiled steps (after --warmup)")
    p.add_argument("--warmup", type=at_least(0, "untimed steps"), default=5)
    p.add_argument("--kernels", default=None, help="write the per-kernel table (with op paths) here")
    p.add_argument("--trace", default=None, help="write a Chrome trace here")
    p.add_argument("--gaps", type=at_least(0, "gaps listed"), default=10, help="list this many of the longest GPU-idle gaps")
    p.add_argument("--sync", action="store_true",
                   help="synchronize after each step, as fp8vit-bench's synchronized median does, and say where "
                   "such a step's time goes: GPU busy, idle before its first kernel, between kernels, after the last "
                   "(default: steps back to back, as a training loop runs them)")
    p.add_argument("--ncu-step", action="store_true",
                   help="after warm-up, run one step between cudaProfilerStart/Stop (for ncu) and exit")
    a = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.ncu_step and device != "cuda":
        p.error("--ncu-step marks a step for Nsight Compute: it needs a CUDA GPU")
    why = unavailable(a.variant, device)
    if why:  # said in one line, with the variants that do run here, instead of a traceback from the step
        print(f"fp8vit-profile: --variant {a.variant} cannot run here: {why}. Variants that can: "
              f"{', '.join(v for v in VARIANTS if not unavailable(v, device))}", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    wl = build_workload(a.model, a.variant, batch_size=a.batch_size, img_size=a.img_size, device=device)
    opt = make_optimizer(wl.model.parameters(), "sgd", lr=1e-3, device=device)
    step = train_step_fn(wl, opt)
    x, y = synthetic_batch(a.batch_size, wl, device=device)
    for _ in range(a.warmup):
        step(x, y)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    if a.ncu_step:
        torch.cuda.profiler.start()
        step(x, y)
        sync()
        torch.cuda.profiler.stop()
        return 0
    if a.sync:  # the bench's synchronized median: each step timed alone
        wall_ms = median_ms(step, x, y, device=device, reps=a.steps, warmup=0)
    else:
        watch = Stopwatch(device).start()
        for _ in range(a.steps):
            step(x, y)
        wall_ms = watch.elapsed_ms() / a.steps
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(a.steps):
            if a.sync:
                with torch.profiler.record_function(STEP_RANGE):
                    step(x, y)
                    sync()
            else:
                step(x, y)
        sync()
    if a.trace:
        prof.export_chrome_trace(a.trace)
    if device == "cuda":  # GPU kernels, microseconds each
        events = trace_events(prof)
        kernels = trace_kernels(events)
        launches = _launches(prof)
        # The profiler ties a CUDA graph's kernels to the op around each replay more than once, so
        # when the op-attributed total disagrees with the trace, the trace's kernels are used
        # as they are, without op paths.
        traced = sum(us for _, _, us in kernels)
        if abs(sum(us for _, _, us in launches) - traced) > 0.01 * traced:
            launches = [(name, "(no op path: CUDA graph replay)", us) for name, _, us in kernels]
        what = "GPU kernel"
    else:  # no kernels on CPU: aten ops' self time, so nothing is counted twice
        launches = [(e.key, e.key, e.self_cpu_time_total) for e in prof.key_averages() if e.key.startswith("aten::")]
        what = "CPU op"
    br = kernel_breakdown([(k, us) for k, _, us in launches], a.steps)
    size = "" if a.img_size == 224 else f" at {a.img_size} px"
    print(f"{a.model} batch {a.batch_size}{size} {a.variant}: wall {wall_ms:.1f} ms/step "
          f"({'synchronized median, ' if a.sync else ''}unprofiled), "
          f"{what} time {br['total']:.1f} ms/step")
    for cat in [c for c, _ in CATEGORIES] + ["other"]:
        if cat in br:
            print(f"  {cat:26s} {br[cat]:8.2f} ms  {100 * br[cat] / br['total']:5.1f}%")
    if device == "cuda" and a.sync:
        ex, gaps = step_exposure(kernels, step_windows(events))
        print(f"  synchronized step {ex['step'] / 1e3:.2f} ms (profiled): GPU busy {ex['busy'] / 1e3:.2f}, idle before "
              f"the first kernel {ex['lead'] / 1e3:.2f}, between kernels {ex['gaps'] / 1e3:.2f} in "
              f"{len(gaps) / a.steps:.0f} gaps, after the last {ex['tail'] / 1e3:.2f}; longest in-step gaps:")
        # the step ranges are not host work of their own: the ops inside them are
        host = trace_host_ops([e for e in events if e.get("name") != STEP_RANGE])
    elif device == "cuda":
        busy, span, gaps = idle_gaps(kernels)
        print(f"  GPU busy {busy / 1e3 / a.steps:.2f} of {span / 1e3 / a.steps:.2f} ms/step (first to last kernel); "
              f"idle {(span - busy) / 1e3 / a.steps:.2f} ms/step in {len(gaps) / a.steps:.0f} gaps/step; longest:")
        host = trace_host_ops(events)
    if device == "cuda":
        for us, before, after, start in gaps[:a.gaps]:
            print(f"    {us / 1e3:7.3f} ms  after {before[:60]}  before {after[:60]}")
            meanwhile = host_during(host, start, start + us)
            print("              host meanwhile: " + ", ".join(f"{n[:40]} {t / 1e3:.3f}" for n, t in meanwhile if t > 0))
    table = kernel_table(launches, a.steps)
    if a.kernels:
        with open(a.kernels, "w") as f:
            f.write(f"# {a.model} batch {a.batch_size}{size} {a.variant}: {br['total']:.2f} ms {what} time/step, "
                    f"wall {wall_ms:.1f} ms/step\n# ms/step  calls/step  category  kernel  <-  launching op path\n")
            for kernel, path, calls, ms in table:
                f.write(f"{ms:9.3f} {calls:7.1f}  {categorize(kernel):12.12s}  {kernel[:110]}  <-  {path}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
