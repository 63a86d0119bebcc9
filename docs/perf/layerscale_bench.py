"""LayerScale's cost in a bf16 residual block, timm's way against the multiply in the stream's dtype
(docs/performance.md, lever 22: the cost it measured per step is the basis of that lever).

    python3 docs/perf/layerscale_bench.py          # on the GPU machine

Per residual branch (forward + backward, the branch output ``a`` [B, N, C] bf16, ``gamma`` [C] fp32
trainable, the stream ``x`` bf16):
  timm    x + (gamma * a).to(bf16)        gamma * a promotes to fp32 (what TE_Block's timm LayerScale
                                          and TE_EvaBlock's gamma do under autocast, with the cast back
                                          that FP8Block._residual adds)
  bf16    x + gamma.to(bf16) * a          the product in bf16 (one rounding of gamma, 2^-9 relative)
  fp8vit  LayerScaleAdd.apply(x, a, gamma) lever 22 as shipped: one addcmul forward; backward dy = g * gamma,
                                          dgamma = fp32 sum of g * a (lever 22)
  none    x + a                           no LayerScale: the floor
Times: CUDA events, median of 50 after 10 warm-up; per step = 2 branches x depth blocks.
"""

import torch

from fp8vit.blocks.base import LayerScaleAdd
from fp8vit.tools.timing import median_ms

SHAPES = {"RoPE ViT-B b128": (128, 197, 768, 12), "EVA02-L b64": (64, 257, 1024, 24),
          "PE-core-L b32": (32, 577, 1024, 24), "ViT-H b128": (128, 257, 1280, 32)}


def branch(kind, x, a, gamma, g):
    a = a.detach().requires_grad_(True)
    if kind == "timm":
        y = x + (gamma * a).to(x.dtype)
    elif kind == "bf16":
        y = x + gamma.to(a.dtype) * a
    elif kind == "fp8vit":
        y = LayerScaleAdd.apply(x, a, gamma)
    else:
        y = x + a
    y.backward(g)


def main():
    torch.manual_seed(0)
    print(f"{'shape':16s} {'timm ms':>8s} {'bf16 ms':>8s} {'fp8vit ms':>9s} {'none ms':>8s}   "
          "per step (2 x depth): timm - none, bf16 - none, fp8vit - none")
    for name, (B, N, C, depth) in SHAPES.items():
        x = torch.randn(B, N, C, device="cuda", dtype=torch.bfloat16)
        a = torch.randn_like(x)
        g = torch.randn_like(x)
        gamma = torch.full((C,), 0.1, device="cuda", requires_grad=True)
        t = {k: median_ms(branch, k, x, a, gamma, g) for k in ("timm", "bf16", "fp8vit", "none")}
        per = 2 * depth
        print(f"{name:16s} {t['timm']:8.3f} {t['bf16']:8.3f} {t['fp8vit']:9.3f} {t['none']:8.3f}   "
              + ", ".join(f"{per * (t[k] - t['none']):6.2f} ms" for k in ("timm", "bf16", "fp8vit")))


if __name__ == "__main__":
    main()
