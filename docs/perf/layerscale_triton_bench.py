"""Lever 24 (docs/performance.md): LayerScaleAdd's backward in one pass (a Triton kernel) against
the torch backward it replaces (lever 22's, still the path off the GPU).

    python3 docs/perf/layerscale_triton_bench.py          # on the GPU machine

The shipped backward (fp8vit.blocks.base.LayerScaleAdd, lever 22) of ``x + gamma * y`` reads the
incoming gradient ``g`` [R, C] twice and writes two [R, C] bf16 tensors:
    dy = g * gamma                 read g,    write dy
    dgamma = (g * y).sum(0, fp32)  read g, y, write g*y; read g*y
6 passes over [R, C] bf16. One kernel reads g and y once and writes dy once (3 passes), summing
g * y per column in fp32 registers (each product exact, where the torch path rounds it to bf16).

Prediction (written before the run): at RoPE ViT-B b128 (R = 128 * 197, C = 768, 24 branches per
step) 3 passes of 38.7 MB per branch at ~3 TB/s: the backward 0.075 -> 0.04 ms per branch, about
-0.9 ms per training step; EVA02-L-sized and ViT-H blocks gain the same fraction of their
LayerScale backward. dy bit-identical to the torch path; dgamma within 1e-3 relative of an fp64 sum.

Times: CUDA events around 10 back-to-back calls (so that the GPU never waits for the host's launch, as
in a graphed step), median of 50 after 10 warm-up (fp8vit.tools.timing.median_ms), divided by 10.
"""

import torch

from fp8vit._te.kernels import layerscale_backward as triton_bwd
from fp8vit.tools.timing import median_ms
from layerscale_bench import SHAPES  # the same four block shapes (this folder is on sys.path when run)


def torch_bwd(g, y, gamma):
    return g * gamma, (g * y).flatten(0, -2).sum(0, dtype=torch.float32)


def per_call_ms(fn, *args, calls=10):
    def many():
        for _ in range(calls):
            fn(*args)
    return median_ms(many) / calls


def main():
    torch.manual_seed(0)
    print(f"{'shape':16s} {'torch bwd ms':>12s} {'triton bwd ms':>13s} {'GB/s triton':>11s}   per step (2 x depth) "
          "saved; dy equal; dgamma max rel err torch / triton vs fp64")
    for name, (B, N, C, depth) in SHAPES.items():
        g = torch.randn(B, N, C, device="cuda", dtype=torch.bfloat16)
        y = torch.randn_like(g)
        gamma = (torch.rand(C, device="cuda") * 0.2).to(torch.bfloat16)
        t_torch = per_call_ms(torch_bwd, g, y, gamma)
        t_triton = per_call_ms(triton_bwd, g, y, gamma)
        dy_t, dg_t = torch_bwd(g, y, gamma)
        dy_k, dg_k = triton_bwd(g, y, gamma)
        ref = (g.double() * y.double()).flatten(0, -2).sum(0)
        err = lambda d: float(((d.double() - ref).abs() / ref.abs().clamp_min(1e-3 * ref.abs().max())).max())
        gbps = 3 * g.numel() * 2 / (t_triton * 1e-3) / 1e9
        print(f"{name:16s} {t_torch:12.4f} {t_triton:13.4f} {gbps:11.0f}   {2 * depth * (t_torch - t_triton):6.2f} ms; "
              f"{bool(torch.equal(dy_t, dy_k))}; {err(dg_t):.2e} / {err(dg_k):.2e}")


if __name__ == "__main__":
    main()
