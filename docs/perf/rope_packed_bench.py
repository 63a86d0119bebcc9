"""Lever 25 (docs/performance.md): RoPE on the packed QKV buffer in one Triton pass
(``fp8vit.layers.RopeQKV``) against TE's RoPE kernel on q and k, the path before it.

    python3 docs/perf/rope_packed_bench.py          # on the GPU machine, TE installed

Per block, bf16, forward + backward of what lies between the QKV GEMM and the projection:
  te      SplitQKV views -> TE's fused RoPE on q, on k (new q, k; v a strided view) -> TE attention,
          which finds no layout for q, k, v and copies them contiguous; backward: TE's RoPE on dq,
          dk, then the stack of dq, dk, dv into the GEMM's gradient
  triton  RopeQKV: one pass writes a packed buffer with q, k rotated and v copied -> TE attention
          reads it in place (bs3hd); backward: its packed gradient rotated in place, no stack
  none    SplitQKV -> attention, no RoPE: the floor
Shapes: RoPE ViT-B/16 b128 (197 tokens, 12 x 64), EVA02-B/14 b128 (257 tokens, 12 x 64), PE-core-L/14
336 b32 (577 tokens, 16 x 64); per step = depth blocks.

Prediction (written before the run): RoPE ViT-B's RoPE kernels (2.6 ms per step), QKV stack
(0.7 ms) and v copy (~0.3 ms) are ~3.6 ms of the step; the Triton path moves 10 passes of
[B, N, H D] per block where these move 14 at about half the bandwidth: about 1.8 ms, so
**-1.5 to -2 ms per RoPE ViT-B step** (with lever 24: 36.8 -> ~34 ms, ~2.3x timm eager).
Times: CUDA events around 10 back-to-back calls, median of 50 after 10 warm-up, divided by 10.
"""

import timm
import torch

from fp8vit.eva import TE_EvaBlock
from fp8vit.layers import FP8Block
from fp8vit.tools.timing import median_ms

SHAPES = {"RoPE ViT-B b128": ("vit_base_patch16_rope_224", 128, 224, 12),
          "EVA02-B b128": ("eva02_base_patch14_224", 128, 224, 12),
          "PE-core-L b32": ("vit_pe_core_large_patch14_336", 32, 336, 24)}


def step(blk, kind, qkv, rope, g):
    qkv = qkv.detach().requires_grad_(True)
    if kind == "triton":
        q, k, v, _ = blk._heads(qkv, rope)
    else:
        q, k, v, _ = FP8Block._heads(blk, qkv, rope if kind == "te" else None)
    o = blk._impl.attention(blk.attn, q, k, v)
    o.backward(g)


def main():
    torch.manual_seed(0)
    print(f"{'shape':16s} {'te ms':>8s} {'triton ms':>9s} {'none ms':>8s}   per step (depth blocks): "
          "te - none, triton - none, saved; max |triton - te| / max |te| of the attention output")
    for name, (model, B, img, depth) in SHAPES.items():
        m = timm.create_model(model, pretrained=False, depth=1, img_size=img)
        blk = TE_EvaBlock.from_timm(m.blocks[0], backend="te").cuda().to(torch.bfloat16)
        rope = m.rope.get_embed().cuda()  # [N_patch, 2 D], as Eva hands it to its blocks
        N = rope.shape[0] + blk.cfg.num_prefix_tokens
        A = blk.cfg.num_heads * blk.cfg.head_dim
        qkv = torch.randn(B, N, 3 * A, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(B, N, A, device="cuda", dtype=torch.bfloat16)

        def per_call(kind, calls=10):
            def many():
                for _ in range(calls):
                    step(blk, kind, qkv, rope, g)
            return median_ms(many) / calls

        t = {k: per_call(k) for k in ("te", "triton", "none")}
        with torch.no_grad():
            o_te = blk._impl.attention(blk.attn, *FP8Block._heads(blk, qkv, rope)[:3])
            o_tr = blk._impl.attention(blk.attn, *blk._heads(qkv, rope)[:3])
        diff = float((o_tr.float() - o_te.float()).abs().max() / o_te.float().abs().max())
        print(f"{name:16s} {t['te']:8.3f} {t['triton']:9.3f} {t['none']:8.3f}   "
              f"{depth * (t['te'] - t['none']):6.2f} ms, {depth * (t['triton'] - t['none']):6.2f} ms, "
              f"{depth * (t['te'] - t['triton']):6.2f} ms; {diff:.1e}")


if __name__ == "__main__":
    main()
