"""Host time of the graph cache's dispatch before the first CUDA-graph replay of a step, on the CPU.

    .venv/bin/python dev/graph_dispatch_host_time.py vit_pe_core_large_patch14_336

Why: a synchronized step pays the host work between the last eager kernel before the blocks and the
first graph replay as GPU idle time (ViT-B graphed's profile: one 0.76 ms gap there; PE-core-L's:
1.39 ms). TE's capture is replaced by tests/test_graphs.py's fake, so this runs without a GPU: it
times the Python of fp8vit's dispatch (the model at 56 px, bf16 CPU autocast), not TE's or the GPU's.

Prints the median time from norm_pre's end to block 0's replay, and the time per step in the
dispatch's methods (each wrapped with a timer).
"""

import collections
import functools
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
warnings.simplefilter("ignore")

import timm  # noqa: E402
import torch  # noqa: E402
from _pytest.monkeypatch import MonkeyPatch  # noqa: E402

import fp8vit  # noqa: E402
import test_graphs as T  # noqa: E402
from fp8vit.training import graph_cache as GC  # noqa: E402

MARKS = {}
SPENT = collections.Counter()


def _timed_fake_graph(target=None, make=T._fake_graph):
    replay = make(target)

    def call(x, **kw):
        MARKS.setdefault("replay", time.perf_counter())
        return replay(x, **kw)
    return call


def _timer(cls, name):
    f = getattr(cls, name)

    @functools.wraps(f)
    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            SPENT[name] += time.perf_counter() - t
    setattr(cls, name, timed)


def main(name: str, steps: int = 30) -> None:
    T._fake_graph = _timed_fake_graph
    T._FakeTE(MonkeyPatch())
    torch.manual_seed(0)
    model = timm.create_model(name, img_size=56, num_classes=10)
    fp8vit.convert_to_te(model, backend="reference")
    # the blocks alone (the gap between norm_pre and the first replay; a hook on norm_pre would take
    # a stem graphed by default out of the graphs anyway)
    handle = fp8vit.make_graphed_blocks(model, stem=False)
    model.norm_pre.register_forward_hook(lambda *a: MARKS.__setitem__("norm_pre", time.perf_counter()))
    x = torch.randn(2, 3, 56, 56)

    def step() -> float:
        MARKS.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        out.float().sum().backward()
        for p in model.parameters():
            p.grad = None
        return MARKS.get("replay", float("nan")) - MARKS["norm_pre"]  # nan: no replay (observe, capture)

    for _ in range(3):  # observe, capture, replay
        step()
    gap = statistics.median(step() for _ in range(steps))
    for method in ("_choose", "_changed", "_fingerprint", "_replay", "_copy_aliased_grads", "_spec", "_busy"):
        _timer(GC.GraphedBlocks, method)
    for _ in range(steps):
        step()
    print(f"{name}: per-block graphs {handle.per_block}, {sum(1 for _ in model.blocks.parameters())} block "
          f"parameters; norm_pre -> first replay {gap * 1e6:.0f} us (median of {steps} steps)")
    for method, s in SPENT.most_common():
        print(f"  {method:22s} {s / steps * 1e6:7.0f} us/step (nested calls counted in their callers too)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "vit_pe_core_large_patch14_336")
