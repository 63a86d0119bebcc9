"""Host time of the pieces a synchronized graphed step runs before its first replay.

    bash docs/perf/h200.sh hostcosts:vit_base_patch16_224:128   (te_env.sh puts the repository on PYTHONPATH)

Why: dev/step_timeline.py (H100, lever 42) finds a synchronized ViT-B step's GPU idle 0.9 ms, all of
it before the first graph replay: entering ``fp8_context`` 0.22 ms, the stem 0.30 (its host time 0.55
against 0.27 of kernels), the graph dispatch 0.49. On the CPU, fp8vit's own part of ``fp8_context``
takes 13 us and the dispatch's parameter check (``_fingerprint``) 70 us: the rest is TE, CUDA
autocast or the GPU host's slower Python, which only that host can say.

What: (1) each context and call on its own, ``timeit`` medians in microseconds: torch autocast (CPU,
CUDA), TE's autocast with a fixed recipe, ``make_recipe``, ``fp8_context`` with no recipe, a name and a
recipe object, the graph dispatch's ``_fingerprint`` and ``_choose``; (2) cProfile of ``--steps``
pipelined training steps of the bench's workload (the bench's step: forward under ``fp8_context``, loss,
backward, optimizer): the functions with the most own time; (3) cProfile of the host work a
synchronized step does before its first graph replay (from the step's start to the forward graph's
``replay`` call: the part the GPU waits for), by own and by cumulative time, which names what to cut.
cProfile slows Python several-fold; the ranking, not the times, is the result of parts (2) and (3).
"""

import cProfile
import io
import pstats
import statistics
import timeit

import torch
import torch.nn.functional as F

import fp8vit
from fp8vit import _te
from fp8vit._te.recipes import make_recipe
from fp8vit.training import graph_cache as GC

import probe  # dev/: the probes' shared command line and workload


def _us(fn, number: int = 2000, repeat: int = 5) -> float:
    """Median over ``repeat`` runs of ``fn``'s mean time over ``number`` calls, in microseconds."""
    return statistics.median(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def _enter_exit(make):
    def run():
        with make():
            pass
    return run


def contexts() -> None:
    rows = [("torch.autocast('cpu', bf16)", _enter_exit(lambda: torch.autocast("cpu", dtype=torch.bfloat16))),
            ("torch.autocast('cuda', bf16)", _enter_exit(lambda: torch.autocast("cuda", dtype=torch.bfloat16)))]
    if _te.te_status().ok:
        recipe = make_recipe("delayed")
        rows += [("make_recipe('delayed')", lambda: make_recipe("delayed")),
                 ("te.autocast(recipe object)", _enter_exit(lambda: _te.autocast(True, recipe))),
                 ("fp8_context()", _enter_exit(lambda: fp8vit.fp8_context())),
                 ("fp8_context('delayed')", _enter_exit(lambda: fp8vit.fp8_context("delayed"))),
                 ("fp8_context(recipe object)", _enter_exit(lambda: fp8vit.fp8_context(recipe)))]
    for name, fn in rows:
        print(f"  {name:34s} {_us(fn):8.1f} us")
    if _te.te_status().ok:
        pr = cProfile.Profile()
        pr.enable()
        run = _enter_exit(lambda: fp8vit.fp8_context())
        for _ in range(2000):
            run()
        pr.disable()
        _print_stats(pr, "fp8_context() enter and exit, 2000 times", 15)


def _print_stats(pr: cProfile.Profile, title: str, n: int, key: str = "tottime") -> None:
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats(key).print_stats(n)
    lines = buf.getvalue().splitlines()
    start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
    print(f"\n{title}: {'own' if key == 'tottime' else 'cumulative'} time, top {n}")
    print("\n".join(lines[start:start + n + 1]))


def main() -> None:
    a = probe.parse_args(__doc__, "host_costs", 50, "the host costs of CUDA autocast, TE and the graphs")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; host (CPU) microseconds per call, timeit medians: not GPU time")
    contexts()
    wl, opt, x, y = probe.build(a)

    def step():
        with fp8vit.fp8_context(wl.recipe, enabled=wl.variant.te_fp8):
            loss = F.cross_entropy(wl.net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(10):  # capture and warm-up
        step()
    torch.cuda.synchronize()
    handle = GC.GraphedBlocks.of(wl.model) if a.variant.endswith("graphed") else None
    if handle is not None and handle._fingerprint_at_capture:
        print(f"  {'graph dispatch _fingerprint(0)':34s} {_us(lambda: handle._fingerprint(0)):8.1f} us")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(a.steps):
        step()
    torch.cuda.synchronize()
    pr.disable()
    _print_stats(pr, f"{a.model} b{a.batch_size} {a.variant}, {a.steps} pipelined steps under cProfile", 30)
    if handle is not None:
        before_replay(step, a)


def before_replay(step, a) -> None:
    """Part (3): cProfile from a synchronized step's start to its first ``CUDAGraph.replay`` call."""
    pr = cProfile.Profile()
    replay = torch.cuda.CUDAGraph.replay
    seen = [0]

    def first_replay_stops(graph):
        seen[0] += 1
        if seen[0] == 1:
            pr.disable()
        return replay(graph)
    torch.cuda.CUDAGraph.replay = first_replay_stops
    try:
        for _ in range(a.steps):
            seen[0] = 0
            pr.enable()
            step()
            pr.disable()  # a no-op where the replay stopped it
            torch.cuda.synchronize()
    finally:
        torch.cuda.CUDAGraph.replay = replay
    title = f"{a.model} b{a.batch_size} {a.variant}, {a.steps} synchronized steps up to the first replay"
    _print_stats(pr, title, 30)
    _print_stats(pr, title, 30, "cumtime")


if __name__ == "__main__":
    main()
