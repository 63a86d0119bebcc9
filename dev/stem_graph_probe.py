"""What a ViT's stem in a CUDA graph would save a synchronized step: the upper bound of lever 55.

    bash dev/device_run.sh '. docs/perf/te_env.sh; mkdir -p $out/levers; python3 dev/stem_graph_probe.py \\
        > $out/levers/stem_graph_probe_vit_base_patch16_224_b128_$gpu.log'

Why: a synchronized graphed step (what timm's train.py runs: it reads ``loss.item()`` every step)
idles the GPU ~0.9 ms at ViT-B b128 on an H100 (dev/step_timeline.py), all of it host work before
the blocks' first replay, and the stem is the largest piece: 0.55 ms of host time for 0.27 ms of
kernels (patch GEMM, the images' cast, the weight casts, the class token's cat, the position add).
Graphing the stem with the blocks (one forward graph from the images) is a large change to the
graph cache; this probe measures its stem share first, with the blocks graphed as today.

How: the bench's workload (``--variant``, default ``fp8vit-fp8-delayed-graphed``), warmed up (the
blocks' graphs captured); then the stem (patch embedding, class and register tokens, position
embedding, patch drop, ``norm_pre``) as its own graph, ``torch.cuda.make_graphed_callables`` under
bf16 autocast without the cast cache, behind an instance ``forward_features`` that calls it, the
blocks (their graph dispatch as today) and the final norm. Both paths train the same model: they
take turns, ``--rounds`` rounds of ``--steps`` steps each, synchronized (CUDA events around each
step, then a synchronize: the idle before the first kernel counts) and pipelined (events at step
boundaries, no synchronize), medians over all rounds; each path's first two steps of a round are
not timed. A check before the timing: both paths' gradients of one batch from the same weights
(the stem's parameters and the first block's), each as a fraction of the other's norm.

Prediction (written before the first run): ViT-B b128, H100: synchronized -0.25 to -0.4 ms (idle
0.9 -> 0.5-0.65), pipelined within +-0.1 (the same kernels, one replay for ~7 launches; the bench's one
batch is the capture's sample, so no copy into the graph's input: a loader's batches add ~0.03 ms). Build the stem into the blocks'
graph only if the synchronized gain is >= 0.25 ms (ViT-B 1.80x -> ~1.82x; the dispatch's ~0.5 ms
stays).
"""

import itertools
import statistics

import torch
import torch.nn.functional as F
from torch import nn

from fp8vit import fp8_context
from fp8vit.tools.timing import Stopwatch
from fp8vit.tools.workload import train_step_fn

import probe  # dev/: the probes' shared command line and workload


class Stem(nn.Module):
    """A timm ViT's ``forward_features`` up to the blocks, with the ViT's own modules and
    parameters (the same objects: their gradients reach the model's) and nothing else of it."""

    def __init__(self, vit: nn.Module):
        super().__init__()
        self.patch_embed, self.patch_drop, self.norm_pre = vit.patch_embed, vit.patch_drop, vit.norm_pre
        for name in ("cls_token", "reg_token", "pos_embed"):
            p = getattr(vit, name, None)
            if isinstance(p, nn.Parameter):
                self.register_parameter(name, p)
        self._vit = (vit,)  # a tuple: not a submodule (the graph's parameters are the stem's alone)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        vit = self._vit[0]
        # [B, 3, H, W] -> [B, N, C] -> [B, prefix + N, C]
        return self.norm_pre(self.patch_drop(vit._pos_embed(self.patch_embed(x))))


def main() -> None:
    a = probe.parse_args(__doc__, "stem_graph_probe", 20, "CUDA graphs", warmup=8, rounds=6)
    wl, opt, x, y = probe.build(a)
    model = wl.model

    def forward_loss():
        with fp8_context(wl.recipe, enabled=wl.variant.te_fp8):
            return F.cross_entropy(wl.net(x), y)

    train_step = train_step_fn(wl, opt)  # the bench's step: forward under fp8_context, backward, optimizer

    def step():
        train_step(x, y)

    for _ in range(a.warmup):  # the blocks' graphs are captured at the second step
        step()
    torch.cuda.synchronize()

    stem = Stem(model)
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):  # no cached casts in a graph
        torch.cuda.make_graphed_callables(stem, (x,))  # stem.forward replays from now on

    def stem_graphed_features(t: torch.Tensor, attn_mask=None, is_causal: bool = False) -> torch.Tensor:
        # timm >= 1.0.30 passes these on; a training step here has neither
        assert attn_mask is None and not is_causal and not model.grad_checkpointing
        return model.norm(model.blocks(stem(t)))

    paths = {"blocks graphed (today)": None, "stem graphed too": stem_graphed_features}

    def use(path: str) -> None:
        if paths[path] is None:
            model.__dict__.pop("forward_features", None)  # the class's forward_features again
        else:
            model.forward_features = paths[path]

    watched = [(n, p) for n, p in model.named_parameters() if p.requires_grad and
               n.startswith(("patch_embed.", "cls_token", "reg_token", "pos_embed", "blocks.0."))]
    grads = {}
    for path in paths:
        use(path)
        forward_loss().backward()
        grads[path] = [p.grad.detach().float().clone() for _, p in watched]
        opt.zero_grad(set_to_none=True)
    worst = max(((g0 - g1).norm() / g0.norm().clamp_min(1e-30)).item()
                for g0, g1 in zip(*grads.values()))
    print(f"gradients of one batch, the two paths: largest difference {worst:.2e} of a norm over {len(watched)} "
          "parameters (the stem's and block 0's; FP8 scales move between the two forwards)")

    times = {(path, mode): [] for path in paths for mode in ("synchronized", "pipelined")}
    for r in range(a.rounds):
        for path in paths:
            use(path)
            for _ in range(2):
                step()
            torch.cuda.synchronize()
            watch = Stopwatch("cuda")
            for _ in range(a.steps):  # synchronized: the GPU's time from before the host starts
                watch.start()
                step()
                times[(path, "synchronized")].append(watch.elapsed_ms())
            events = [torch.cuda.Event(enable_timing=True) for _ in range(a.steps + 1)]
            events[0].record()
            for ev in events[1:]:  # pipelined: step boundaries, the host ahead
                step()
                ev.record()
            torch.cuda.synchronize()
            times[(path, "pipelined")] += [e0.elapsed_time(e1) for e0, e1 in itertools.pairwise(events)]
    use("blocks graphed (today)")

    print(f"\n{a.model} batch {a.batch_size} {a.variant}, {torch.cuda.get_device_name()}; "
          f"{a.rounds} rounds of {a.steps} steps per path and mode, taken in turn; ms")
    print(f"{'path':28s} {'synchronized':>12s} {'p10-p90':>13s} {'pipelined':>10s} {'p10-p90':>13s}")
    med = {}
    for path in paths:
        row = []
        for mode in ("synchronized", "pipelined"):
            v = sorted(times[(path, mode)])
            med[(path, mode)] = statistics.median(v)
            row.append(f"{med[(path, mode)]:>{12 if mode == 'synchronized' else 10}.3f} "
                       f"{v[len(v) // 10]:6.2f}-{v[len(v) * 9 // 10]:6.2f}")
        print(f"{path:28s} {' '.join(row)}")
    base, new = paths
    print(f"stem graphed, change: synchronized {med[(new, 'synchronized')] - med[(base, 'synchronized')]:+.3f} ms, "
          f"pipelined {med[(new, 'pipelined')] - med[(base, 'pipelined')]:+.3f} ms")


if __name__ == "__main__":
    main()
