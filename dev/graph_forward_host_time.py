"""Host time of TE 2.20's graphed forward against fp8vit's lean one (lever 41), on the CPU.

    .venv/bin/python dev/graph_forward_host_time.py

TE's ``new_fwd`` as tests/test_te_graph_forward.py reproduces it, over a module tree shaped like
fp8vit's blocks (per block: the fused QKV, attention with 5 submodules, proj, MLP, 4 identities),
the inner graph call a no-op: the time per step of the walk and of its replacement, for ViT-B's
and ViT-H's whole-stack graphs and PE-core-L's 24 per-block ones.
"""

import statistics
import sys
import time
from pathlib import Path

from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import test_te_graph_forward as T  # noqa: E402

from fp8vit._te import lean_graphed_forward  # noqa: E402


def block(i):
    attn = T.DotProductAttention(f"attn{i}")
    for k in range(5):  # TE's attention holds its backends (flash, fused, unfused + softmax, dropout)
        attn.add_module(f"k{k}", nn.Identity())
    return nn.Sequential(T.TEModule(f"qkv{i}"), attn, T.TEModule(f"proj{i}"), T.TEModule(f"mlp{i}"),
                         *[nn.Identity() for _ in range(4)])


def per_step(forwards, reps=300):
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for f in forwards:
            f(None)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main():
    T.Manager.added = []
    T.Manager.add_fp8_tensors_to_global_buffer = classmethod(lambda cls, meta: None)  # TE's: returns at once
    for name, blocks, graphs in (("ViT-B/16, one graph", 12, 1), ("ViT-H/14, one graph", 32, 1),
                                 ("PE-core-L/14, per block", 24, 24)):
        stacks = [nn.Sequential(*[block(i) for i in range(blocks // graphs)]) for _ in range(graphs)]
        te = [T._te_forward(s, {m for m in s.modules() if isinstance(m, T.TEModule)}, T.Helpers(), []) for s in stacks]
        lean = [lean_graphed_forward(f) for f in te]
        assert all(type(f).__name__ == "_LeanForward" for f in lean)
        a, b = per_step(te), per_step(lean)
        print(f"{name}: TE's forward {a:.0f} us/step, lean {b:.0f} us/step ({a - b:.0f} us less; "
              f"{sum(len(list(s.modules())) for s in stacks)} modules walked)")


if __name__ == "__main__":
    main()
