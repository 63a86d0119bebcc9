"""Where a synchronized graphed step's GPU-idle time goes, segment by segment, without a profiler.

    PYTHONPATH=. python3 dev/step_timeline.py --model vit_base_patch16_224 --batch-size 128

Why: fp8vit-bench's synchronized median (what timm's train.py sees: it reads ``loss.item()`` each
step) is 0.8 ms longer than the pipelined one at ViT-B on an H100 (30.4 against 29.5 ms), and the
profiler's own overhead (31.8 ms profiled) hides which host work the GPU waits for: its longest gap,
0.7-1.4 ms, lies inside ``fp8vit::graphed_blocks`` with no op in it.

How: the bench's step (``fp8vit.tools.workload.train_step_fn``'s five lines, written out here with
marks between them) with a mark at each point below: the host's clock (``perf_counter``) and a CUDA
event on the current stream. Hooks and wrappers set the marks inside the forward: the stem, the
graph dispatch's check (``_choose``), TE's graphed forward, each ``CUDAGraph.replay`` (the forward's
and the backward's), the head. The step runs ``--steps`` times synchronized (as the bench's median)
and as many back to back (pipelined). Per segment (from one mark to the next) it prints the median
host time of the synchronized steps and the GPU time between the segment's events in both runs:
pipelined, the host is ahead and the GPU time is the segment's kernels; synchronized, whatever more
the GPU spent there it spent idle, waiting for the host. "GPU behind": at each mark of the
synchronized steps, how much work the GPU still had queued (its time since the step's first mark
less the host's); about 0 where the host is the bottleneck. "GC": the host time Python's cyclic
garbage collector ran inside the segment, per synchronized step (a mean: most steps have none), read
from ``gc.callbacks``; the run's collections per generation are summed up below the table.
``--gc 0`` disables the collector for the timed steps, to see what it costs a step as a whole.
"""

import collections
import gc
import itertools
import math
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import fp8vit
from fp8vit import fp8_context
from fp8vit._te import graph_forward
from fp8vit.training import graph_cache as GC

import probe  # dev/: the probes' shared command line and workload


class Marks:
    """One step's marks, in order: ``(name, host seconds, CUDA event)``."""

    def __init__(self):
        self.on = False
        self.rows = []
        self.replays = 0
        self.seen = collections.Counter()

    def __call__(self, name: str) -> None:
        if not self.on:
            return
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        self.seen[name] += 1  # per-block graphs pass the same point once per block: number them
        self.rows.append((name if self.seen[name] == 1 else f"{name} #{self.seen[name]}", time.perf_counter(), ev))

    def take(self):
        rows, self.rows, self.replays = self.rows, [], 0
        self.seen.clear()
        return rows


MARK = Marks()


class GCTimes:
    """Python's collections while marks are on: ``(host start, host stop, generation)``
    (a ``gc.callbacks`` entry)."""

    def __init__(self):
        self.events, self._start = [], None

    def __call__(self, phase: str, info: dict) -> None:
        if not MARK.on:
            return
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.events.append((self._start, time.perf_counter(), info["generation"]))
            self._start = None


GC_TIMES = GCTimes()


def _wrap_exit(cls, name: str, mark: str) -> None:
    f = getattr(cls, name)

    def wrapped(*a, **k):
        out = f(*a, **k)
        MARK(mark)
        return out
    setattr(cls, name, wrapped)


def instrument(model) -> None:
    """Marks on a timm ViT's stem, blocks and head (with the stem in the graphs: around the
    dispatch on ``forward_features``), the graph dispatch, TE's graphed forward and every CUDA-graph
    replay (process-wide: the class methods are replaced)."""
    handle = GC.GraphedBlocks.of(model)
    if handle is not None and handle.stem:
        # the stem and final norm in the graphs (lever 55): no module hooks on them (the stem would
        # leave the graphs); marks around the dispatch on forward_features instead
        forward = GC.GraphedBlocks._forward

        def marked(self, i, x, *a, **k):
            MARK("forward_features called")
            out = forward(self, i, x, *a, **k)
            MARK("forward_features returned")
            return out
        GC.GraphedBlocks._forward = marked
    else:
        model.patch_embed.register_forward_pre_hook(lambda *a: MARK("stem: patch_embed called"))
        # a ViT calls model.blocks (a Sequential, graphed whole); EVA-style models loop over a
        # ModuleList (graphed per block), which is never called itself
        first, last = ((model.blocks,) * 2 if isinstance(model.blocks, nn.Sequential)
                       else (model.blocks[0], model.blocks[-1]))
        first.register_forward_pre_hook(lambda *a: MARK("stem done: blocks called"))
        last.register_forward_hook(lambda *a: MARK("blocks returned"))
    model.head.register_forward_hook(lambda *a: MARK("head done"))
    _wrap_exit(GC.GraphedBlocks, "_choose", "dispatch: _choose done")
    lean_call = graph_forward._LeanForward.__call__

    def lean(self, *a, **k):
        MARK("TE graphed forward called")
        if not getattr(self, "_timeline", False):
            inner = self._graphed

            def graphed(*a2, **k2):
                MARK("TE functionalized called (module walk done)")
                return inner(*a2, **k2)
            self._graphed, self._timeline = graphed, True
        return lean_call(self, *a, **k)
    graph_forward._LeanForward.__call__ = lean
    replay = torch.cuda.CUDAGraph.replay

    def timed_replay(self):
        MARK.replays += MARK.on  # counted in the marked steps only (take() starts each at 0)
        MARK(f"graph replay {MARK.replays} called")
        replay(self)
        MARK(f"graph replay {MARK.replays} returned")
    torch.cuda.CUDAGraph.replay = timed_replay


def main() -> None:
    a = probe.parse_args(__doc__, "step_timeline", 30, "CUDA events time the GPU side", warmup=8, gc=1)
    print(f"fp8vit from {fp8vit.__file__}")  # an A/B's before side runs an earlier tree's (dev/ab_bench.sh)
    wl, opt, x, y = probe.build(a)
    instrument(wl.model)

    def step():  # train_step_fn's step, with marks
        MARK("step start")
        with fp8_context(wl.recipe, enabled=wl.variant.te_fp8):
            MARK("fp8_context entered")
            out = wl.net(x)
            loss = F.cross_entropy(out, y)
            MARK("loss")
        MARK("fp8_context exited")
        loss.backward()
        MARK("backward returned")
        opt.step()
        MARK("optimizer stepped")
        opt.zero_grad(set_to_none=True)
        MARK("zero_grad done")
        return loss.detach()

    for _ in range(a.warmup):
        step()
    torch.cuda.synchronize()
    handle = GC.GraphedBlocks.of(wl.model)
    eager_before = None if handle is None else handle.eager_calls
    gc.callbacks.append(GC_TIMES)
    if not a.gc:
        gc.collect()
        gc.disable()
    runs = {}
    for mode in ("synchronized", "pipelined"):
        MARK.on = True
        steps = []
        for _ in range(a.steps):
            step()
            if mode == "synchronized":
                MARK("synchronize called")
                torch.cuda.synchronize()
            steps.append(MARK.take())
        torch.cuda.synchronize()
        MARK.on = False
        runs[mode] = steps
        if mode == "synchronized":
            sync_gc, GC_TIMES.events = GC_TIMES.events, []
    gc.enable()
    names = [n for n, _, _ in runs["synchronized"][0]]
    seg = collections.defaultdict(lambda: collections.defaultdict(list))
    for mode, steps in runs.items():
        for rows in steps:
            if [n for n, _, _ in rows] != names[:len(rows)]:
                raise SystemExit(f"step_timeline: marks differ between steps: {[n for n, _, _ in rows]} vs {names}")
            for (n0, h0, e0), (n1, h1, e1) in itertools.pairwise(rows):
                seg[(n0, n1)][f"{mode} host"].append((h1 - h0) * 1e3)
                seg[(n0, n1)][f"{mode} gpu"].append(e0.elapsed_time(e1))
                if mode == "synchronized":
                    # a collection counts in the segment where it started
                    seg[(n0, n1)]["gc"].append(sum(t1 - t0 for t0, t1, _ in sync_gc if h0 <= t0 < h1) * 1e3)
                    # how far the GPU trails the host at the mark: a synchronized step's GPU reaches
                    # its first mark (nothing queued) as the host records it, so the GPU's time since
                    # then less the host's is its backlog; about 0: the GPU waits for the host there
                    seg[(n0, n1)]["behind"].append(rows[0][2].elapsed_time(e1) - (h1 - rows[0][1]) * 1e3)
        ends = [rows[0][2].elapsed_time(rows[-1][2]) for rows in steps]
        print(f"{mode}: first mark to last, GPU time, median {statistics.median(ends):.3f} ms over {len(steps)} steps")
    if handle is not None and handle.eager_calls != eager_before:
        # a timeline of eager steps is not the graphed step's (session 47: hooks refused the stem graph)
        raise SystemExit(f"step_timeline: the timed steps ran eagerly ({dict(handle.eager_reasons)}): {handle.describe()}")
    size = "" if a.img_size == 224 else f" at {a.img_size} px"
    print(f"\n{a.model} batch {a.batch_size}{size} {a.variant}, {torch.cuda.get_device_name()}; medians over {a.steps} steps, ms")
    print(f"{'segment (from the mark before to this one)':58s} {'host sync':>9s} {'GPU sync':>9s} {'GPU pipe':>9s} "
          f"{'idle':>7s} {'host pipe':>9s} {'GPU behind':>10s} {'GC':>6s}")
    idle_total = 0.0
    for n0, n1 in itertools.pairwise(names):
        s = seg[(n0, n1)]
        med = {k: statistics.median(v) for k, v in s.items()}
        idle = med["synchronized gpu"] - med.get("pipelined gpu", float("nan"))
        idle_total += 0.0 if math.isnan(idle) else idle
        print(f"  {n1[:56]:56s} {med['synchronized host']:9.3f} {med['synchronized gpu']:9.3f} "
              f"{med.get('pipelined gpu', float('nan')):9.3f} {idle:7.3f} {med.get('pipelined host', float('nan')):9.3f} "
              f"{med['behind']:10.3f} {statistics.fmean(s['gc']):6.3f}")
    print(f"  idle (synchronized GPU time less pipelined), summed over segments: {idle_total:.3f} ms/step")
    per_gen = collections.Counter(g for _, _, g in sync_gc)
    print(f"  Python GC in the synchronized steps ({'on' if a.gc else 'off: --gc 0'}): "
          f"{sum((t1 - t0) for t0, t1, _ in sync_gc) * 1e3 / a.steps:.3f} ms/step, collections per generation "
          f"{dict(sorted(per_gen.items()))} over {a.steps} steps")


if __name__ == "__main__":
    main()
