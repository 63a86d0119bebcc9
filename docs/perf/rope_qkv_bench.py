"""Lever 19's microbenchmark: RoPE on the packed QKV GEMM output, today's way against TE's fused-QKV
kernel with timm's (3, H, D) order kept (docs/performance.md, lever 19, catch (b)).

    python3 docs/perf/rope_qkv_bench.py          # on the GPU machine, TE installed

Per shape (EVA02-B b128, EVA02-L b64, RoPE ViT-B b128, PE-core-L b32), forward + backward of:
  today   q, k, v = views of qkv [B, N, 3, H, D] (fp8vit.blocks.base.SplitQKV); TE's fused RoPE on q and on k
          (two launches each way); the backward stacks dq, dk, dv into the packed gradient
  fused   TE's apply_fused_qkv_rotary_pos_emb on qkv viewed as one head of width 3A (interleaved
          pairs, angles repeated per head): one launch each way, the gradient comes back packed
Both are checked against each other first (outputs and the packed gradient, exact up to the order
of float operations). Times: CUDA events, median of 50 after 10 warm-up, ratios within this run.
"""

import torch

import fp8vit  # noqa: F401  (loads TE before torch's first cuDNN kernel)
from fp8vit import _te
from fp8vit.blocks.eva import rope_angles
from fp8vit.blocks.base import SplitQKV
from fp8vit.tools.timing import median_ms

SHAPES = {"EVA02-B b128": (128, 257, 12, 64), "EVA02-L b64": (64, 257, 16, 64),
          "RoPE ViT-B b128": (128, 197, 12, 64), "PE-core-L b32": (32, 577, 16, 64)}


def today(qkv, angles, H, D):
    B, N, _ = qkv.shape
    q, k, v = SplitQKV.apply(qkv.view(B, N, 3, H, D))
    return _te.fused_rope(q, angles, True), _te.fused_rope(k, angles, True), v


def fused(qkv, wide, H, D):
    B, N, W = qkv.shape
    A = H * D
    rope = _te.te_module("transformer_engine.pytorch.attention.rope")
    q, k, v = rope.apply_fused_qkv_rotary_pos_emb(qkv.view(B, N, 1, W), wide, wide, [A, A, A],
                                                  tensor_format="bshd", interleaved=True)
    return q.view(B, N, H, D), k.view(B, N, H, D), v.view(B, N, H, D)


def step(fn, qkv, table, H, D, grads):
    x = qkv.detach().requires_grad_(True)
    outs = fn(x, table, H, D)
    torch.autograd.backward(outs, grads)
    return outs, x.grad




def main():
    torch.manual_seed(0)
    print(f"{'shape':18s} {'today ms':>9s} {'fused ms':>9s} {'fused/today':>11s} {'max |diff| out':>15s} {'grad':>9s}")
    for name, (B, N, H, D) in SHAPES.items():
        qkv = torch.randn(B, N, 3 * H * D, device="cuda", dtype=torch.bfloat16)
        theta = torch.rand(N - 1, D // 2, device="cuda") * 6
        table = torch.cat([theta.repeat_interleave(2, -1).sin(), theta.repeat_interleave(2, -1).cos()], -1)
        angles = rope_angles(table, N, 1)  # [N, 1, 1, D], 0 for the class token
        wide = angles.repeat(1, 1, 1, H).contiguous()  # [N, 1, 1, H*D]
        grads = [torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        (o1, g1), (o2, g2) = step(today, qkv, angles, H, D, grads), step(fused, qkv, wide, H, D, grads)
        diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(o1, o2))
        gdiff = float((g1.float() - g2.float()).abs().max())
        t1 = median_ms(step, today, qkv, angles, H, D, grads)
        t2 = median_ms(step, fused, qkv, wide, H, D, grads)
        print(f"{name:18s} {t1:9.3f} {t2:9.3f} {t2 / t1:11.2f} {diff:15.2e} {gdiff:9.2e}")


if __name__ == "__main__":
    main()
