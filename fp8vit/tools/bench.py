"""``fp8vit-bench``: fp8vit against what a user would pick instead, in one process and one run.

    fp8vit-bench                      # ViT-B/16, batch 128: about 2-3 minutes on an H200
    fp8vit-bench --full               # ViT-H/16 (huge), batch 128: about 5-7 minutes
    fp8vit-bench --model huge --batch-size 128 --steps 30 --plot bench.png --json bench.json

Variants (``fp8vit.tools.workload``): timm bf16 eager and compiled, torchao float8 compiled, a
plain ``te.TransformerLayer`` (the raw-TE reference), fp8vit in bf16 and in FP8 per recipe, eager
and with the blocks CUDA-graphed. By default it runs what a user would choose between
(:func:`default_variants`: timm eager, timm compiled, torchao, and fp8vit at its fastest here) on
ViT-B (:data:`DEFAULTS`), where the two compiles take most of the time; ``--full`` runs them on
ViT-H; ``--variants all`` runs every variant, ``--variants NAME ...`` those named. For
each: median step time with its spread (p10-p90) over the timed steps after warm-up, images/s,
model TFLOP/s (n/a for a model the count does not describe) and the fraction of the GPU's dense
bf16 peak, peak memory, speedup against timm bf16 eager measured in the same run, and optionally
cost per million images. Ratios are only meaningful within one run (H200 step times drift ~5%
between runs). An estimate of the run's time comes first (on a GPU) and a progress line follows each
variant with the time left (:class:`RunEstimate`: each variant's compile or graph capture and its
steps, H200 timings corrected from what has run). Warnings raised while the variants run, and those
TE raised when ``import fp8vit`` imported it, are listed once each, at the end.

Two step times: synchronized (the host waits for each step, so host work the GPU waits for counts)
and pipelined (steps issued back to back, as a training loop without ``.item()`` runs them).
``--max-batch`` first finds the largest batch that fits, each probe in a new process.

Several GPUs: under ``torchrun --nproc-per-node N`` every process runs the variants on its own GPU
with the model in ``DistributedDataParallel`` (after the CUDA-graph capture, before
``torch.compile``), ``--batch-size`` images per GPU; rank 0 reports: img/s and $ per 1M images over
all N GPUs, TFLOP/s and memory per GPU.
``--nproc 1 N ...`` runs the whole bench once per process count (1: one plain process, no DDP;
N: under ``torch.distributed.run``) and adds the scaling table: img/s at each count and the scaling
efficiency img/s(N) / (N * img/s(1)) per variant. On a CPU the processes use gloo.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .. import _te
from ..training.detect import gpu_info
from .cli import IMAGE_SIDE, RECOMPUTE_EVERY, at_least, more_than
from .console import WarningLog
from .timing import Stopwatch, format_duration
from .workload import (SIZES, VARIANTS, ModelShape, Variant, build_workload, make_optimizer, model_shape,
                       synthetic_batch, train_flops, train_step_fn)

__all__ = ["main", "run_variant", "run_interleaved", "unavailable", "default_variants", "largest_fitting",
           "probe_in_fresh_process", "DENSE_BF16_PEAK", "RunEstimate", "variant_kind", "DEFAULTS"]

# Dense (no sparsity) bf16 tensor-core peak from the vendors' datasheets, FLOP/s, by name prefix.
DENSE_BF16_PEAK = {"H100": 989e12, "H200": 989e12, "H20": 148e12, "GH200": 989e12, "B200": 2250e12,
                   "L40S": 362e12, "L4": 121e12, "RTX 4090": 165e12}


# (model, batch, timed steps, warm-up) when not given, by device, without and with --full. The
# default fits about 3 minutes on an H200: ViT-B/16 at batch 128 took 6 s (timm eager), 31 s
# (compiled), 65-78 s (torchao) and 7 s (fp8vit graphed) there, plus the process's start; ViT-H,
# --full, about 5-7 minutes (torchao's compile alone 2-3.5 min).
DEFAULTS = {("cuda", False): ("base", 128, 30, 10), ("cuda", True): ("huge", 128, 30, 10),
            ("cpu", False): ("micro", 4, 3, 1), ("cpu", True): ("base", 4, 3, 1)}


def _peak(name: str) -> Optional[float]:
    for key in sorted(DENSE_BF16_PEAK, key=len, reverse=True):
        if key in name:
            return DENSE_BF16_PEAK[key]
    return None


def _best_fp8vit(info) -> str:
    """fp8vit's fastest precision here: FP8 in the GPU's default recipe, or bf16 without FP8."""
    return f"fp8vit-fp8-{info.default_recipe}" if info.fp8.ok else "fp8vit-bf16"


def default_variants(info, device: str) -> List[str]:
    """What a user would choose between, for a run of a few minutes: timm bf16 eager and compiled,
    torchao float8 compiled, and fp8vit at its fastest (its best precision here, blocks CUDA-graphed
    on a GPU; eager on CPU, where graphs cannot run).

    Args:
        info: :func:`fp8vit.gpu_info`'s answer (the default recipe).
        device: ``"cuda"`` or ``"cpu"``.
    """
    best = _best_fp8vit(info) + ("-graphed" if device == "cuda" else "")
    return ["timm-bf16", "timm-bf16-compile", "torchao-fp8-compile", best]


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


# What a variant's run takes on an H200 (torch 2.11, TE 2.20), by part, as functions of the model's
# shape: the priors of :class:`RunEstimate`. From the runs' JSON (warmup_s: compile included) and
# logs (each variant's whole time): docs/results/bench/vit_{base,large,huge}_patch16_224_b128_all10_h200.json
# and docs/results/bench/*_default4_h200.{json,log}.
# Building the model on the host: 0.6 s + 19 ms per million parameters (ViT-B 2.2 s, ViT-L 6.4 s,
# ViT-H 12.6 s; the default4 runs' eager variants less their steps: 1.9-3.4 s at 86 M, 6.0-6.5 s at 300 M).
_BUILD_S = (0.6, 0.019e-6)
# A kind's own setup, a + b * depth seconds: torch.compile 6 + 1.4 s per block (ViT-B 24 s, ViT-L 35,
# ViT-H 54); torchao float8, compiled, 18 + 3.2 s per block (59, 89, 125); CUDA-graph capture about
# 2 s (default4 runs: 0-4 s); eager none. EVA-style blocks compile slower (EVA02-B: 45 and 91 s): the
# measured compile of the run corrects it.
_SETUP_S = {"eager": (0.0, 0.0), "graphed": (2.0, 0.0), "compile": (6.0, 1.4), "torchao": (18.0, 3.2)}
# timm bf16 eager reaches about a third of the dense bf16 peak (ViT-B 28%, ViT-L 34%, ViT-H 37%) ...
_EAGER_PEAK_FRACTION = 0.33
# ... and the other kinds' steps take this fraction of its step (ViT-B, L, H at batch 128:
# compile 0.80-0.86, torchao 0.88-0.97, FP8 graphed 0.59-0.60, bf16 graphed 0.74-0.83).
_STEP_RATIO = {("eager", False): 1.0, ("eager", True): 0.9, ("graphed", False): 0.8, ("graphed", True): 0.6,
               ("compile", False): 0.82, ("torchao", False): 0.9}
# A FLOP count (workload.train_flops) is trusted up to this many tokens' worth per image, FLOPs / (6 x
# parameters): ViTs at 224 px count 180-260 (ViT-B/16 203, ViT-L/16 202), a ViT-B/16 at 1024 px (4097
# tokens, global attention) about 7,700. Past it the count is wrong, and the prior takes a ViT's 197
# tokens instead: train_flops reads timm's HybridEmbed (ViTamin, R50+ViT) by its patch_size, (1, 1) on
# the conv stem's 16x-reduced features, as 1-px patches of the image: 50,176 tokens at 224 px and
# attention quadratic in them, about 3000x the FLOPs (ViTamin-B 663,000 tokens' worth, R50+ViT-B 514,000).
# Its step at batch 128 then read 137 s, the bench's first estimate 6.3 h (measured: 127 ms, 2 min).
_MAX_TOKENS_PER_IMAGE = 32768
_FALLBACK_TOKENS = 197
# Which measured setups correct which priors: the compiles correct each other; eager and graphed
# runs (the model's build, and a capture of a few seconds) correct each other.
_SETUP_CLASS = {"eager": "build", "graphed": "build", "compile": "compile", "torchao": "compile"}


def variant_kind(variant: str) -> str:
    """``"eager"``, ``"graphed"``, ``"compile"`` (torch.compile) or ``"torchao"`` (its compile)."""
    v = Variant.parse(variant)
    return ("torchao" if v.fp8 == "torchao" else "compile" if v.compile or v.block_compile
            else "graphed" if v.graphed else "eager")


class RunEstimate:
    """How long the bench's variants take: each run is a setup fixed by the variant's kind plus its
    steps, first from H200 timings (the priors above, for the model's shape), then corrected from
    what has run.

    A run's time = setup (building the model, plus torch.compile's or torchao's compile, or the
    CUDA-graph capture) + ``steps_per_run`` x its step time. When a run finishes, its setup is what
    its time leaves beyond its steps at its median step time. Corrections, as ratios of sums over the
    runs so far (measured / prior): the step times, one ratio for every kind (the GPU's speed); the
    setups, one ratio per class (a compile corrects compiles, an eager or graphed run corrects eager
    and graphed runs); a class with no run yet keeps its prior. Failed runs correct nothing.

    The step's prior is the model's FLOPs at a third of the GPU's bf16 peak: the shape's count, or,
    without one or past ``_MAX_TOKENS_PER_IMAGE`` tokens' worth per image (a miscount: the hybrids'
    conv-stem embedding), a ViT's count at 197 tokens; :attr:`doubt` then says so.

    Args:
        shape: the model's (:func:`~fp8vit.tools.workload.model_shape`); None: a ViT-B's.
        steps_per_run: warm-up, timed and pipelined steps of each run.
        peak: the GPU's dense bf16 FLOP/s (None: an H200's).
    """

    def __init__(self, shape: Optional[ModelShape], steps_per_run: int, peak: Optional[float] = None):
        self.shape = shape or ModelShape(12, 86_567_656, 105.4e9)
        self.steps_per_run = steps_per_run
        self.peak = peak or DENSE_BF16_PEAK["H200"]
        self._step = [0.0, 0.0]  # measured, prior (ms)
        self._setup = {c: [0.0, 0.0] for c in set(_SETUP_CLASS.values())}  # measured, prior (s)
        # model FLOPs of a step per image; without a count (not a ViT) or with an implausible one, a
        # ViT's: 6 per parameter and token at 197 tokens
        sh, fallback = self.shape, 6.0 * self.shape.params * _FALLBACK_TOKENS
        tokens = sh.flops_per_image / (6.0 * sh.params) if sh.flops_per_image and sh.params > 0 else 0.0
        #: why the model's FLOP count was set aside ("" when it was used or there was none)
        self.doubt = (f"the model's FLOP count, {tokens:,.0f} tokens' worth per image, set aside as "
                      f"implausible: {_FALLBACK_TOKENS} tokens assumed" if tokens > _MAX_TOKENS_PER_IMAGE else "")
        self.flops_per_image = fallback if self.doubt or not sh.flops_per_image else sh.flops_per_image

    def prior(self, variant: str, batch: int) -> Tuple[float, float]:
        """``(setup seconds, step milliseconds)`` of ``variant`` at ``batch`` before any correction."""
        kind, sh = variant_kind(variant), self.shape
        a, b = _SETUP_S[kind]
        setup = _BUILD_S[0] + _BUILD_S[1] * sh.params + a + b * sh.depth
        flops = self.flops_per_image * batch
        eager_ms = flops / (_EAGER_PEAK_FRACTION * self.peak) * 1e3
        return setup, eager_ms * _STEP_RATIO.get((kind, Variant.parse(variant).te_fp8), 1.0)

    def _factor(self, pair: List[float]) -> float:
        return pair[0] / pair[1] if pair[1] > 0 else 1.0

    def seconds(self, variant: str, batch: int) -> float:
        """The run's predicted time, corrected from the runs recorded so far."""
        setup, step_ms = self.prior(variant, batch)
        setup *= self._factor(self._setup[_SETUP_CLASS[variant_kind(variant)]])
        return setup + self.steps_per_run * step_ms * self._factor(self._step) / 1e3

    def left(self, runs) -> float:
        """Predicted seconds for ``runs``, ``(variant, batch)`` pairs still to run."""
        return sum(self.seconds(v, b) for v, b in runs)

    def record(self, variant: str, batch: int, took_s: float, median_ms: Optional[float]) -> None:
        """A finished run: its whole time and its median step (None: it failed; nothing learnt)."""
        if median_ms is None:
            return
        setup, step_ms = self.prior(variant, batch)
        self._step[0] += median_ms
        self._step[1] += step_ms
        pair = self._setup[_SETUP_CLASS[variant_kind(variant)]]
        pair[0] += max(took_s - self.steps_per_run * median_ms / 1e3, 0.0)
        pair[1] += setup


class _Run:
    """One variant's model, optimizer and batch, built and ready to step (:func:`run_variant`,
    :func:`run_interleaved`)."""

    def __init__(self, variant: str, *, model: str, batch: int, device: str, optimizer: str, img_size: int,
                 mlp_recompute: int, world: int, drop_path: Optional[float]):
        torch.manual_seed(0)
        self.variant, self.batch, self.world, self.device, self.img_size = variant, batch, world, device, img_size
        self.free_gib = torch.cuda.mem_get_info()[0] / 2**30 if device == "cuda" else None
        held = torch.cuda.memory_allocated() if device == "cuda" else 0
        built = Stopwatch(device).start()
        self.wl = build_workload(model, variant, batch_size=batch, img_size=img_size, device=device,
                                 mlp_recompute=mlp_recompute, ddp=world > 1, drop_path_rate=drop_path)
        self.build_s = built.elapsed_ms() / 1e3  # the model's build and, for -graphed variants, the graph capture
        # Bench learning rates are small and fixed: the step time, not the training, is measured.
        self.opt = make_optimizer(self.wl.model.parameters(), optimizer, lr=1e-3 if optimizer == "sgd" else 1e-4,
                                  device=device)
        self.step = train_step_fn(self.wl, self.opt)
        self.x, self.y = synthetic_batch(batch, self.wl, device=device)
        self.own_bytes = (torch.cuda.memory_allocated() - held) if device == "cuda" else 0
        self.loss = None
        self.warm_s = 0.0
        self.peak_bytes = None

    def warm_up(self, steps: int) -> None:
        """``steps`` untimed steps (torch.compile compiles here)."""
        watch = Stopwatch(self.device).start()
        for _ in range(steps):
            self.loss = self.step(self.x, self.y)
        self.warm_s = watch.elapsed_ms() / 1e3

    def timed(self) -> float:
        """One synchronized step's time (ms): from the GPU reaching its first kernel to its last."""
        watch = Stopwatch(self.device).start()
        self.loss = self.step(self.x, self.y)
        return watch.elapsed_ms()

    def pipelined(self, steps: int) -> List[float]:
        """``steps`` steps issued back to back, each timed between events at the step boundaries."""
        events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        events[0].record()
        for ev in events[1:]:
            self.loss = self.step(self.x, self.y)
            ev.record()
        events[-1].synchronize()
        return [a.elapsed_time(b) for a, b in zip(events, events[1:])]

    def result(self, times: List[float], piped: Optional[List[float]]) -> Dict:
        q = _deciles(times)
        med = statistics.median(times)
        flops = train_flops(self.wl.model, self.batch, self.img_size)  # None: a model the count does not describe
        out = {"variant": self.variant, "batch": self.batch, "world": self.world, "median_ms": med,
               "p10_ms": q[0], "p90_ms": q[-1], "min_ms": min(times), "max_ms": max(times),
               "images_per_s": self.batch * self.world / med * 1e3,
               "tflops": flops / (med * 1e-3) / 1e12 if flops is not None else None, "loss": float(self.loss),
               "build_s": self.build_s, "warmup_s": self.warm_s,
               "peak_mem_gib": self.peak_bytes / 2**30 if self.peak_bytes is not None else None,
               "free_gib_at_start": self.free_gib}
        if piped:
            pq = _deciles(piped)
            out.update(pipelined_median_ms=statistics.median(piped), pipelined_p10_ms=pq[0], pipelined_p90_ms=pq[-1])
        if self.device == "cuda" and self.wl.variant.blocks in ("fp8vit", "te-layer"):
            # TE's attention backend ("fused": cuDNN; "unfused" is a slow fallback a setup problem causes)
            out["attention"] = _te.attention_backend()
        if self.wl.graphs:
            out["graph_replays"] = sum(g.replays for g in self.wl.graphs)
            out["graph_eager_calls"] = sum(g.eager_calls for g in self.wl.graphs)
        return out

    def close(self) -> None:
        for g in self.wl.graphs:
            g.release()
        self.wl = self.opt = self.step = self.x = self.y = None


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def run_variant(variant: str, *, model: str, batch: int, steps: int, warmup: int, device: str,
                optimizer: str = "sgd", img_size: int = 224, mlp_recompute: int = 0,
                pipelined: bool = True, world: int = 1, drop_path: Optional[float] = None) -> Dict:
    """Build, warm up and time one variant. Returns its measurements (times in ms).

    Each timed step is synchronized: its time runs from the GPU reaching the step's first kernel to
    its last, so host work the GPU waits for counts. With ``pipelined`` (CUDA only), as many steps
    again are issued back to back without waiting, as a training loop does, and each is timed
    between events recorded at the step boundaries (idle gaps included).

    Args:
        world: processes in the default process group (``torchrun``); above 1 the model runs in
            ``DistributedDataParallel``, ``batch`` is per process and images/s counts all of them.
        drop_path: timm's ``drop_path_rate`` for every variant's model (None: the model's default).
    """
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    run = _Run(variant, model=model, batch=batch, device=device, optimizer=optimizer, img_size=img_size,
               mlp_recompute=mlp_recompute, world=world, drop_path=drop_path)
    run.warm_up(warmup)
    times = [run.timed() for _ in range(steps)]
    if device == "cuda":  # alone in the process: its peak is the process's, the build's included
        run.peak_bytes = torch.cuda.max_memory_allocated()
    piped = run.pipelined(steps) if pipelined and device == "cuda" else None
    out = run.result(times, piped)
    run.close()
    del run
    _free(device)
    return out


def run_interleaved(variants: List[str], *, model: str, batch: int, steps: int, warmup: int, device: str,
                    optimizer: str = "sgd", img_size: int = 224, mlp_recompute: int = 0,
                    pipelined: bool = True, world: int = 1, drop_path: Optional[float] = None,
                    burst: int = 5) -> List[Dict]:
    """:func:`run_variant` for several variants at once, their steps timed in turn: every variant is
    built and warmed up first, then each round times one synchronized step of each (the order
    rotating from round to round), and pipelined steps in bursts of ``burst`` (after one that starts
    the GPU, not counted), in turn as well.

    Why: one variant after the other, a drift over the process (clocks, the host, the allocator)
    reads as a difference between them. Seen on an H100: timm's own compiled Hiera-B measured 50.3
    ms, then 53.5 ms after another variant, the same compiled graph. In turn, a drift falls on every
    variant alike. Every model is held at once (their activations are not: one step runs at a
    time); a variant's peak memory is its own (its build's and its warm-up's peak above the rest).
    ``mlp_recompute`` applies to fp8vit's variants, as ``--mlp-recompute``.
    """
    runs = []
    try:
        for v in variants:
            run = _Run(v, model=model, batch=batch, device=device, optimizer=optimizer, img_size=img_size,
                       mlp_recompute=_recompute_for(v, mlp_recompute), world=world, drop_path=drop_path)
            runs.append(run)
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            run.warm_up(warmup)
            if device == "cuda":  # its own: its model's memory and its warm-up's peak above the rest
                run.peak_bytes = run.own_bytes + torch.cuda.max_memory_allocated() - before
        times: Dict[str, List[float]] = {r.variant: [] for r in runs}
        piped: Dict[str, List[float]] = {r.variant: [] for r in runs}
        for i in range(steps):
            for r in runs[i % len(runs):] + runs[:i % len(runs)]:
                times[r.variant].append(r.timed())
        if pipelined and device == "cuda":
            for i in range(max(1, steps // burst)):
                for r in runs[i % len(runs):] + runs[:i % len(runs)]:
                    piped[r.variant] += r.pipelined(burst + 1)[1:]  # the first starts on an idle GPU
        return [dict(r.result(times[r.variant], piped[r.variant] or None), interleaved=len(runs)) for r in runs]
    finally:
        for r in runs:
            r.close()
        del runs
        _free(device)


def _unfused_note(rows: List[dict]) -> Optional[str]:
    """A line under the table naming the variants whose attention TE ran unfused, or None."""
    unfused = [r["variant"] for r in rows if r.get("attention") == "unfused"]
    if not unfused:
        return None
    return (f"note: Transformer Engine ran attention unfused (slow: not cuDNN's kernels) in {', '.join(unfused)}: "
            "a setup problem, these times are not representative (NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2 says why)")


def _deciles(times: List[float]) -> List[float]:
    return statistics.quantiles(times, n=10) if len(times) >= 2 else [times[0]] * 9


def largest_fitting(probe: Callable[[int], Optional[float]], start: int, limit: int = 4096,
                    granularity: int = 8) -> int:
    """Largest multiple of ``granularity`` <= ``limit`` for which ``probe(batch)`` fits (0 if none).

    ``probe(batch)`` returns None if the batch does not fit, else the fraction of the memory it
    could use that the step's peak took (``math.nan`` if unknown). Fitting is assumed monotone in the
    batch. A probe of a large model costs a process start (about 20 s for ViT-H), so the search uses
    the memory line: two fitting batches (``start`` and ``2 * start``) give the memory per image, and
    the first guess is where that line reaches the whole memory. Probes then step away from the
    guess (``granularity``, then 2x, 4x, ... further; down, never past the bisection point) until the
    answer is bracketed; without a usable line (unknown or flat peaks), the search doubles from
    ``2 * start`` until a batch fails. Bisection closes the bracket.
    """
    g = granularity
    seen: Dict[int, Optional[float]] = {}
    lo, hi = 0, limit + g  # lo fits (or is 0), hi does not (or is past the limit)

    def settle(b: int) -> bool:
        nonlocal lo, hi
        seen[b] = probe(b)
        if seen[b] is None:
            hi = b
        else:
            lo = b
        return seen[b] is not None

    # 1. two points of the memory line
    for b in (start, 2 * start):
        b = min(b // g * g, limit)
        if not lo < b < hi or not settle(b):
            break
    # 2. its guess, then up to three probes stepping away from it in the direction the first one tells
    fitted = [b for b in sorted(seen) if seen[b] is not None]
    if len(fitted) >= 2:
        (b1, b2), (f1, f2) = fitted[:2], (seen[fitted[0]], seen[fitted[1]])
        slope = (f2 - f1) / (b2 - b1)
        guess = int(b2 + (1.0 - f2) / slope) // g * g if slope > 0 else None  # NaN: no guess
        if guess is not None:
            guess, step, first = min(max(guess, lo + g), limit), g, None
            while lo < guess < hi:
                up = settle(guess)
                if first is not None and up != first:
                    break  # bracketed
                first = up
                if up:  # no failure may be known yet: step up, doubling
                    guess = min(guess + step, limit)
                else:  # step down, doubling, but never below the bisection point
                    guess = max(guess - step, (lo + hi) // 2 // g * g)
                step *= 2
    # 3. no batch has failed yet: double
    while hi > limit and lo < limit:
        settle(min(max(2 * lo, g), limit))
    # 4. bisect
    while hi - lo > g:
        settle((lo + hi) // 2 // g * g)
    return lo


def probe_in_fresh_process(variant: str, *, model: str, batch: int, optimizer: str, img_size: int,
                           mlp_recompute: int = 0, drop_path: Optional[float] = None) -> Optional[float]:
    """Run two training steps (one warm-up, one timed) of ``variant`` at ``batch`` in a new process.

    A new process per probe because probes in one process are not independent: on the H200, after
    one CUDA-graphed ViT-H run at a batch, the same batch no longer fit in the same process, although
    torch reported its memory released (docs/performance.md, lever 14).

    Returns:
        None if the steps ran out of memory; else the step's peak memory as a fraction of the GPU
        memory that was free when the probe started (``math.nan`` on CPU).

    Raises:
        RuntimeError: the probe failed for another reason than running out of memory (its message).
    """
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "probe.json")
        cmd = [sys.executable, "-m", "fp8vit.tools.bench", "--model", model, "--batch-size", str(batch),
               "--steps", "1", "--warmup", "1", "--variants", variant, "--optimizer", optimizer,
               "--img-size", str(img_size), "--mlp-recompute", str(mlp_recompute), "--no-pipelined",
               "--json", path] + ([] if drop_path is None else ["--drop-path", str(drop_path)])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(path):
            raise RuntimeError(f"probe of {variant} at batch {batch} exited with {proc.returncode}: "
                               f"{' '.join(cmd)}\n{proc.stderr[-2000:]}")
        with open(path) as f:
            (row,) = json.load(f)["results"]
    if "median_ms" in row:
        if row.get("peak_mem_gib") is None or not row.get("free_gib_at_start"):
            return math.nan
        return row["peak_mem_gib"] / row["free_gib_at_start"]
    if "OutOfMemoryError" in row["skipped"]:
        return None
    raise RuntimeError(f"probe of {variant} at batch {batch}: {row['skipped']}")


def _recompute_for(variant: str, every: int) -> int:
    """``--mlp-recompute`` applies to the variants that run fp8vit's blocks."""
    return every if Variant.parse(variant).blocks == "fp8vit" else 0


def _max_batch_variants(given: Optional[List[str]], info) -> List[str]:
    """timm-bf16 and the fp8vit FP8 variants of ``given`` (None: the default recipe, eager and graphed)."""
    if given is None:
        best = _best_fp8vit(info)
        return ["timm-bf16", best, f"{best}-graphed"]
    fp8 = [v for v in given if Variant.parse(v).blocks == "fp8vit" and Variant.parse(v).te_fp8]
    return ["timm-bf16", *dict.fromkeys(fp8)]


def _max_batches(variants: List[str], *, model: str, start: int, optimizer: str, img_size: int,
                 mlp_recompute: int, drop_path: Optional[float] = None) -> Dict[str, int]:
    """Largest batch (multiple of 8) of each variant that fits in memory, each probe a new process
    (:func:`probe_in_fresh_process`, :func:`largest_fitting`); prints every probe."""
    out = {}
    for v in variants:
        def probe(b, v=v):
            t = time.perf_counter()
            used = probe_in_fresh_process(v, model=model, batch=b, optimizer=optimizer, img_size=img_size,
                                          mlp_recompute=_recompute_for(v, mlp_recompute), drop_path=drop_path)
            what = "out of memory" if used is None else f"fits, peak {100 * used:.0f}% of the free memory"
            print(f"  probe {v} at batch {b}: {what} ({time.perf_counter() - t:.0f} s)", flush=True)
            return used

        out[v] = largest_fitting(probe, start)
        print(f"largest batch that fits, {v}: {out[v]}", flush=True)
    return out


def _table(rows: List[Dict], peak: Optional[float], price: Optional[float]) -> str:
    base = next((r for r in rows if r["variant"] == "timm-bf16"), None)
    piped = any("pipelined_median_ms" in r for r in rows)
    w = max([28] + [len(r["variant"]) for r in rows])  # the longest variant name sets the column
    head = (f"{'variant':{w}s} {'median ms':>10s} {'p10-p90 ms':>15s} {'img/s':>8s} {'TFLOP/s':>8s} "
            f"{'% peak':>7s} {'mem GiB':>8s} {'vs timm':>8s}" + (f" {'$/1M img':>9s}" if price else "")
            + (f" {'pipelined ms':>13s} {'vs timm':>8s}" if piped else ""))
    lines = [head, "-" * len(head)]
    for r in rows:
        if "skipped" in r:
            lines.append(f"{r['variant']:{w}s} skipped: {r['skipped']}")
            continue
        has_flops = r["tflops"] is not None
        tflops = f"{r['tflops']:8.1f}" if has_flops else "     n/a"
        pct = f"{100 * r['tflops'] * 1e12 / peak:6.1f}%" if peak and has_flops else "    n/a"
        mem = f"{r['peak_mem_gib']:8.1f}" if r["peak_mem_gib"] is not None else "     n/a"
        speed = f"{base['median_ms'] / r['median_ms']:7.2f}x" if base and "median_ms" in base else "     n/a"
        line = (f"{r['variant']:{w}s} {r['median_ms']:10.1f} {r['p10_ms']:7.1f}-{r['p90_ms']:<7.1f} "
                f"{r['images_per_s']:8.1f} {tflops} {pct} {mem} {speed}")
        if price:
            line += f" {price / 3600 / r['images_per_s'] * 1e6:9.2f}"
        if piped and "pipelined_median_ms" in r:
            ratio = (f"{base['pipelined_median_ms'] / r['pipelined_median_ms']:7.2f}x"
                     if base and "pipelined_median_ms" in base else "     n/a")
            line += f" {r['pipelined_median_ms']:13.1f} {ratio}"
        lines.append(line)
    if piped:
        lines.append("pipelined: as many steps again, issued without waiting for the GPU, each timed between "
                     "step-boundary events; img/s, TFLOP/s and the first 'vs timm' use the synchronized median")
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


def _init_distributed() -> Tuple[int, int]:
    """``(rank, world)``: under ``torchrun`` (its environment variables), this process joins the
    default process group, NCCL with one GPU per process (``LOCAL_RANK``) or gloo on CPUs; else
    ``(0, 1)``."""
    if "LOCAL_RANK" not in os.environ:
        return 0, 1
    import torch.distributed as dist

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), dist.get_world_size()


def _inner_args(a: argparse.Namespace) -> List[str]:
    """The command line of one process count's run under ``--nproc``: what was given, less
    ``--nproc``, ``--json`` and ``--plot`` (the outer run writes those)."""
    args = []
    if a.full:
        args.append("--full")
    for flag, value in (("--model", a.model), ("--img-size", a.img_size), ("--steps", a.steps),
                        ("--warmup", a.warmup), ("--optimizer", a.optimizer),
                        ("--price-per-hour", a.price_per_hour), ("--mlp-recompute", a.mlp_recompute),
                        ("--drop-path", a.drop_path)):
        if value is not None:
            args += [flag, str(value)]
    if a.batch_size:
        args += ["--batch-size", *map(str, a.batch_size)]
    if a.variants:
        args += ["--variants", *a.variants]
    if not a.pipelined:
        args.append("--no-pipelined")
    return args


def _run_scaling(a: argparse.Namespace, device: str) -> int:
    """``--nproc``: the bench once per process count, each in new processes (output streamed), then
    the scaling table; ``--json`` gets every run and the table."""
    runs: Dict[int, Dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in a.nproc:
            path = os.path.join(tmp, f"bench_{n}.json")
            launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]
                      if n > 1 else [sys.executable])
            cmd = launch + ["-m", "fp8vit.tools.bench", *_inner_args(a), "--json", path]
            unit = ("GPU" if device == "cuda" else "process") + ("" if n == 1 else "s" if device == "cuda" else "es")
            print(f"\n=== {n} {unit}: {' '.join(cmd)}", flush=True)
            proc = subprocess.run(cmd)
            if proc.returncode != 0 or not os.path.exists(path):
                print(f"fp8vit-bench --nproc: the run on {n} process(es) exited with {proc.returncode}; "
                      "its output is above", file=sys.stderr)
                return 1
            with open(path) as f:
                runs[n] = json.load(f)
    rows = _scaling_rows(runs)
    print(f"\nscaling, {runs[a.nproc[0]]['model']}, {runs[a.nproc[0]]['environment']['device']} "
          f"(batch per {'GPU' if device == 'cuda' else 'process'}; img/s over all of them, synchronized "
          "medians; efficiency = img/s(N) / (N * img/s(1))):")
    print(_scaling_table(rows, a.nproc))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"nproc": a.nproc, "runs": {str(n): r for n, r in runs.items()}, "scaling": rows}, f, indent=2)
    return 0


def _scaling_rows(runs: Dict[int, Dict]) -> List[Dict]:
    """Per (variant, batch): img/s at each process count, and the efficiency against one process
    (None where a run skipped the variant or has no one-process run)."""
    rows = []
    first = next(iter(runs.values()))
    for r0 in first["results"]:
        key = (r0["variant"], r0["batch"])
        ips = {}
        for n, run in runs.items():
            r = next((r for r in run["results"] if (r["variant"], r["batch"]) == key), {})
            ips[n] = r.get("images_per_s")
        one = ips.get(1)
        eff = {n: (v / (n * one) if v is not None and one else None) for n, v in ips.items()}
        rows.append({"variant": key[0], "batch": key[1], "images_per_s": ips, "efficiency": eff})
    return rows


def _scaling_table(rows: List[Dict], nproc: List[int]) -> str:
    w = max([28] + [len(r["variant"]) for r in rows])
    head = f"{'variant':{w}s} {'batch':>6s}" + "".join(f" {f'img/s x{n}':>11s}" for n in nproc) + "".join(
        f" {f'eff x{n}':>8s}" for n in nproc if n > 1)
    lines = [head, "-" * len(head)]
    for r in rows:
        line = f"{r['variant']:{w}s} {r['batch']:6d}"
        line += "".join(f" {r['images_per_s'][n]:11.1f}" if r["images_per_s"][n] is not None else f" {'skipped':>11s}"
                        for n in nproc)
        line += "".join(f" {100 * r['efficiency'][n]:7.1f}%" if r["efficiency"][n] is not None else f" {'n/a':>8s}"
                        for n in nproc if n > 1)
        lines.append(line)
    return "\n".join(lines)


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
    p.add_argument("--full", action="store_true",
                   help="the full-size run: ViT-H (huge) at batch 128 on a GPU, about 5-7 minutes on an H200 "
                   "(default: ViT-B, about 2-3 minutes); --model and --batch-size still override")
    p.add_argument("--model", default=None, help=f"{sorted(SIZES)} or a timm model name "
                   "(default: base on a GPU, huge with --full; micro on CPU, base with --full)")
    p.add_argument("--batch-size", type=at_least(1, "images per step"), nargs="+", default=None,
                   help="one or more batch sizes (default: 128 on a GPU, 4 on CPU)")
    p.add_argument("--img-size", type=IMAGE_SIDE, default=224)
    p.add_argument("--steps", type=at_least(1, "timed steps"), default=None, help="timed steps (default 30 GPU, 3 CPU)")
    p.add_argument("--warmup", type=at_least(0, "untimed steps"), default=None,
                   help="untimed steps first (default 10 GPU, 1 CPU)")
    p.add_argument("--variants", nargs="+", default=None, choices=(*VARIANTS, "all"), metavar="VARIANT",
                   help="'all', or variant names (%(choices)s); default: timm-bf16, timm-bf16-compile, "
                   "torchao-fp8-compile and fp8vit's fastest here (fp8vit-fp8-<the GPU's default "
                   "recipe>-graphed)")
    p.add_argument("--optimizer", default="sgd", choices=("sgd", "adamw"))
    p.add_argument("--price-per-hour", type=more_than(0, "a GPU's price per hour"), default=None,
                   help="the price of one GPU per hour, for $ per 1M images")
    p.add_argument("--mlp-recompute", type=RECOMPUTE_EVERY, default=0, metavar="K",
                   help="fp8vit variants recompute the MLP activations of every K-th block in backward "
                   "(fp8vit.set_mlp_recompute(every=K); default 0: none)")
    p.add_argument("--drop-path", type=float, default=None, metavar="RATE",
                   help="timm's drop_path_rate (stochastic depth) for every variant's model, as training "
                   "recipes set it (default: the model's own: 0 for ViTs, 0.1 for Swin)")
    p.add_argument("--interleave", action="store_true",
                   help="build and warm up every variant first, then time their steps in turn, one of each per "
                   "round, so that a drift over the process falls on all alike (default: one variant after "
                   "the other, each alone in memory)")
    p.add_argument("--no-pipelined", dest="pipelined", action="store_false",
                   help="time only synchronized steps (default: also as many steps issued back to back)")
    p.add_argument("--max-batch", action="store_true",
                   help="first find the largest batch that fits for timm-bf16 and each fp8vit FP8 variant "
                   "of --variants (default: the default recipe, eager and graphed); each probe is a new "
                   "process, about 20 s for ViT-H on an H200, 4-8 probes per variant")
    p.add_argument("--nproc", type=int, nargs="+", default=None, metavar="N",
                   help="run the bench once per process count, one GPU per process (1: one plain process; "
                   "N > 1: DDP under torch.distributed.run), and add the scaling efficiency table")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="write a bar chart (PNG) here")
    a = p.parse_args(argv)
    if a.drop_path is not None and not 0.0 <= a.drop_path < 1.0:
        p.error(f"--drop-path {a.drop_path}: a rate in [0, 1), as timm's drop_path_rate")
    if a.interleave and a.variants is not None and len(set(a.variants)) != len(a.variants):
        p.error(f"--variants {' '.join(a.variants)} with --interleave: each variant once (their steps already "
                "alternate)")
    if a.interleave and (a.nproc is not None or a.max_batch):
        p.error("--interleave times variants in one process on one GPU: run it without --nproc and --max-batch")
    if a.variants is not None and "all" in a.variants and len(a.variants) > 1:
        p.error(f"--variants {' '.join(a.variants)}: 'all' already names every variant; give it alone")
    if a.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            p.error("--plot needs matplotlib: pip install matplotlib")

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.nproc is not None:
        if "LOCAL_RANK" in os.environ:
            p.error("--nproc launches its own processes: run it without torchrun")
        if a.max_batch:
            p.error("--max-batch with --nproc: find the largest batch on one GPU first (without --nproc)")
        if a.plot:
            p.error("--plot with --nproc: the scaling table is text (and in --json); plot one process "
                    "count's run without --nproc")
        bad = [n for n in a.nproc if n < 1]
        gpus = torch.cuda.device_count() if device == "cuda" else None
        if bad or len(set(a.nproc)) != len(a.nproc):
            p.error(f"--nproc {' '.join(map(str, a.nproc))}: give distinct process counts of 1 or more")
        if gpus is not None and max(a.nproc) > gpus:
            p.error(f"--nproc {max(a.nproc)}: this machine has {gpus} GPU(s), one per process")
        a.nproc = sorted(a.nproc)
        return _run_scaling(a, device)
    rank, world = _init_distributed()
    if rank != 0:  # rank 0 reports; the others run the same steps in silence
        sys.stdout = open(os.devnull, "w")
    try:
        return _bench(a, p, device, world, rank)
    finally:
        if world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()


def _report(rows: List[dict], a: argparse.Namespace, *, model: str, batch: int, env: dict, world: int,
            extra: str) -> None:
    """One batch's table, then the note on unfused attention if any."""
    print(f"\n{model}, batch {batch}{' per process' if world > 1 else ''}, {env['device']}{extra}:")
    # img/s counts every process's images: the price is that of all their GPUs
    print(_table(rows, _peak(env["device"]), a.price_per_hour * world if a.price_per_hour else None))
    note = _unfused_note(rows)
    if note:
        print(note)


def _interleaved(a: argparse.Namespace, variants: List[str], why: Dict[str, Optional[str]], *, model: str,
                 batch: int, steps: int, warmup: int, device: str, world: int, noise: WarningLog) -> List[dict]:
    """``--interleave``: one batch's rows, the available variants timed in turn (:func:`run_interleaved`);
    if one fails, every row says so (they ran as one)."""
    ready = [v for v in variants if not why[v]]
    print(f"batch {batch}: building and warming up {', '.join(ready)}, then {steps} rounds of one step each",
          flush=True)
    watch = Stopwatch(device).start()
    try:
        with noise.collect("interleaved"):
            timed = run_interleaved(ready, model=model, batch=batch, steps=steps, warmup=warmup, device=device,
                                    optimizer=a.optimizer, img_size=a.img_size, mlp_recompute=a.mlp_recompute,
                                    pipelined=a.pipelined, world=world, drop_path=a.drop_path)
    except Exception as err:  # noqa: BLE001 - reported as the rows' result
        failed = f"failed: {type(err).__name__}: {err}"[:300]
        print(f"FAILED {type(err).__name__}: {err}", flush=True)
        timed = [{"variant": v, "batch": batch, "skipped": failed} for v in ready]
    print(f"{len(ready)} variants in {format_duration(watch.elapsed_ms() / 1e3)}", flush=True)
    by = {r["variant"]: r for r in timed}
    return [by.get(v) or {"variant": v, "batch": batch, "skipped": why[v]} for v in variants]


def _bench(a: argparse.Namespace, p: argparse.ArgumentParser, device: str, world: int, rank: int) -> int:
    """The bench in this process (one of ``world`` under torchrun)."""
    if a.max_batch and world > 1:
        p.error("--max-batch under torchrun: find the largest batch on one GPU (one process) first")
    model, batch0, steps, warmup = DEFAULTS[device, a.full]
    defaults = a.model is None and a.batch_size is None and not a.full
    model = a.model or model
    batches = a.batch_size or [batch0]
    steps = a.steps or steps
    warmup = a.warmup if a.warmup is not None else warmup
    # third-party warnings, printed once at the end instead of between the lines
    noise = WarningLog()
    with noise.collect("startup"):
        _te.release_import_warnings()  # TE's from `import fp8vit` (a Jax note): held until now
        info = gpu_info()
        env = _environment(device)
        shape = model_shape(model, a.img_size)
    recompute = f", MLP recompute in every {a.mlp_recompute} block(s) of fp8vit's variants" if a.mlp_recompute else ""
    if a.drop_path is not None:
        recompute += f", drop_path_rate {a.drop_path:g}"
    ddp = f", {world} processes in DDP" if world > 1 else ""
    full = DEFAULTS[device, True]
    print(f"fp8vit-bench: {model}, batch {batches}{' per process' if world > 1 else ''}, {steps} timed steps after {warmup} warm-up, "
          f"optimizer {a.optimizer}{recompute}{ddp}" + (f" (--full: {full[0]}, batch {full[1]})" if defaults else ""))
    print(" ".join(f"{k}={v}" for k, v in env.items()))
    named = list(VARIANTS) if a.variants == ["all"] else a.variants
    variants = named or default_variants(info, device)
    print(f"variants: {', '.join(variants)}" + ("" if named else f" (--variants all: all {len(VARIANTS)})"))
    extra = {}
    if a.max_batch and device == "cuda":
        # Before any timing: this process then holds no GPU memory that the probes would lose.
        extra = _max_batches(_max_batch_variants(named, info), model=model, start=batches[0],
                             optimizer=a.optimizer, img_size=a.img_size, mlp_recompute=a.mlp_recompute,
                             drop_path=a.drop_path)
    why = {}
    for v in variants:
        with noise.collect(v):  # unavailable() imports torchao, which may warn
            why[v] = unavailable(v, device)
    total = len(batches) * len(variants)
    pending = [(v, b) for b in batches for v in variants if not why[v]]
    estimate = RunEstimate(shape, warmup + steps * (2 if a.pipelined and device == "cuda" else 1),
                           _peak(env["device"]) if device == "cuda" else None)
    if device == "cuda" and pending:
        print(f"estimate: about {format_duration(estimate.left(pending))} (H200 timings by variant kind: the "
              "model's build, torch.compile or graph capture, the steps; corrected as variants finish"
              + (f"; {estimate.doubt}" if estimate.doubt else "") + ")", flush=True)
    done = 0
    spent_s = 0.0
    results = []
    for batch in batches:
        if a.interleave:
            rows = _interleaved(a, variants, why, model=model, batch=batch, steps=steps, warmup=warmup,
                                device=device, world=world, noise=noise)
            results.extend(rows)
            _report(rows, a, model=model, batch=batch, env=env, world=world,
                    extra=recompute + ddp + ", steps timed in turn (--interleave)")
            continue
        rows = []
        for v in variants:
            done += 1
            tag = f"[{done}/{total}] " + (f"batch {batch} " if len(batches) > 1 else "") + v
            if why[v]:
                rows.append({"variant": v, "batch": batch, "skipped": why[v]})
                print(f"{tag}: skipped: {why[v]}", flush=True)
                continue
            watch = Stopwatch(device).start()
            try:
                with noise.collect(v):
                    r = run_variant(v, model=model, batch=batch, steps=steps, warmup=warmup, device=device,
                                    optimizer=a.optimizer, img_size=a.img_size, pipelined=a.pipelined,
                                    mlp_recompute=_recompute_for(v, a.mlp_recompute), world=world,
                                    drop_path=a.drop_path)
                what = f"{r['median_ms']:.1f} ms"
            except Exception as err:  # noqa: BLE001 - one broken variant is reported, the rest still run
                r = {"variant": v, "batch": batch, "skipped": f"failed: {type(err).__name__}: {err}"[:300]}
                what = f"FAILED {type(err).__name__}: {err}"
                _free(device)
            took_s = watch.elapsed_ms() / 1e3  # build, warm-up and timing: the GPU has finished them
            r["wall_s"] = took_s
            rows.append(r)
            spent_s += took_s
            pending.remove((v, batch))
            estimate.record(v, batch, took_s, r.get("median_ms"))
            left = (f"about {format_duration(estimate.left(pending))} left" if pending
                    else f"{format_duration(spent_s)} in all")
            print(f"{tag}: {what} ({format_duration(took_s)}; {left})", flush=True)
        _report(rows, a, model=model, batch=batch, env=env, world=world,
                extra=recompute + ddp)
        results.extend(rows)
    if extra:
        print(f"\nlargest batch that fits, {model}{recompute}:")
        for v, b in extra.items():
            print(f"  {v:40s} {b:5d}" + (f"  {b / extra['timm-bf16']:.2f}x timm-bf16" if extra["timm-bf16"] else ""))
    if a.json and rank == 0:
        with open(a.json, "w") as f:
            json.dump({"environment": env, "model": model, "world": world, "steps": steps, "warmup": warmup,
                       "optimizer": a.optimizer, "mlp_recompute": a.mlp_recompute, "drop_path_rate": a.drop_path,
                       "interleaved": a.interleave,
                       "results": results,
                       "max_batch": extra}, f, indent=2)
    if a.plot and rank == 0:
        first = [r for r in results if r["batch"] == batches[0]]
        _plot(first, a.plot, f"{model} training step, batch {batches[0]}, {env['device']}")
    if noise.distinct:
        print("\n" + noise.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
