"""Levers 25 (rejected) and 43 (docs/performance.md): RoPE on the packed QKV buffer in one Triton pass against
TE's RoPE kernel on q and k (``rope_kernel="te"``; the default until lever 43 was measured). Lever 25's kernel lives here only: it was in the
library when it was measured (commit 4ccd229, `docs/results/levers/rope_packed_qkv_triton_microbench_h200.log`)
and was taken out after it, as slower; its autograd function was the library's RopeQKV of today.

    python3 docs/perf/rope_packed_bench.py          # on the GPU machine, TE installed
    python3 docs/perf/rope_packed_bench.py --sweep  # the library kernel alone per launch shape (lever 44)

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
**-1.5 to -2 ms per RoPE ViT-B step**. Measured: +1.4 ms (slower), EVA02-B +0.3 ms, PE-core-L
+2.2 ms per step.
Times: CUDA events around 10 back-to-back calls, median of 50 after 10 warm-up, divided by 10.

Lever 43 (written before its run): the library's kernel (``fp8vit._te.rope_packed_qkv`` through
``RopeQKV``, ``TE_EvaBlock.rope_kernel = "triton"``), column ``packed``: the same 10 passes as lever
25's, but each program takes 4 token rows and loads every head's channels contiguously (the two
halves for rotate-half; whole rows split into pairs in registers for interleaved), no gather. Lever 25's kernel, one
token row a program with a gathered partner load, moved its bytes at about a quarter of the H200's
bandwidth (PE-core-L: 0.55 ms over ``none`` for ~380 MB). At 60-70% of bandwidth the packed pass
costs ~0.1 ms per PE-core-L block against TE's 0.46: predicted **PE-core-L 336 px -0.15 to -0.3 ms
per block (-3.5 to -7 ms per step), RoPE ViT-B and EVA02-B 0 to -0.08 per block (0 to -1 ms)**,
whose TE path already moves its bytes near bandwidth. Measured (H100,
``results/levers/rope_packed_qkv_lever43_microbench_h100.log``): packed - te per step PE-core-L -1.6 ms,
EVA02-B -2.6, RoPE ViT-B +0.4; in the graphed training step (``results/bench/*tritonrope_h100.log``)
-5.5, -3.4 and -2.6 ms: this microbenchmark (FP8 off, one block alone) under-predicts the step.

Lever 44 (``--sweep``, written before its run): the kernel alone, forward (reads q, k, v, writes
them) and in-place backward (reads and writes q, k) for token rows per program (``_ROPE_ROWS``)
1-16 and 4-16 warps (``_ROPE_WARPS``), with the bytes each moves per second. Lever 43's packed
pass costs 0.29 ms over ``none`` per PE-core-L block where its ~380 MB need ~0.13 ms at 3 TB/s,
so the kernel moves its bytes at about half the H100's bandwidth. Prediction: the default (4 rows,
8 warps) within 10% of the best; if a shape is >= 15% faster, PE-core-L 336 px -0.5 to -1.5 ms a
step with it (where the gain holds in the graphed step).
Measured (H100, ``results/levers/rope_packed_qkv_lever44_sweep_h100.log``): every shape within 2% of
the default except 1 row x 16 warps (~15% slower); the kernel moves ~2.7-2.8 TB/s forward and
~2.6 backward, near the H100's bandwidth, so the premise (half the bandwidth) was wrong: no change.
"""

import timm
import torch
import triton
import triton.language as tl

import fp8vit.blocks.eva as eva
from fp8vit.blocks.eva import TE_EvaBlock
from layerscale_triton_bench import per_call_ms  # 10 back-to-back calls per timing (this folder is on sys.path)

SHAPES = {"RoPE ViT-B b128": ("vit_base_patch16_rope_224", 128, 224, 12),
          "EVA02-B b128": ("eva02_base_patch14_224", 128, 224, 12),
          "PE-core-L b32": ("vit_pe_core_large_patch14_336", 32, 336, 24)}


@triton.jit
def rope_qk(X, OUT, TABLE, N, NPT, ROW, H2, D: tl.constexpr, HV, BLOCK_H: tl.constexpr,
            BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr, INTERLEAVED: tl.constexpr,
            BACKWARD: tl.constexpr, COPY_V: tl.constexpr):
    # One program: one token's row of the packed buffer, ROW = 3 H D elements: q and k, 2H heads
    # of D channels, then v (H D). The table row [sin | cos] (2D, fp32) of patch token n - NPT;
    # prefix tokens get cos 1, sin 0 (an exact copy).
    #   forward  out[j] = x[j] cos[j] + sign[j] x[p(j)] sin[j]       (timm's x * cos + rot(x) * sin)
    #   backward dx[i]  = g[i] cos[i] - sign[i] g[p(i)] sin[p(i)]    (its transpose)
    # p pairs channel j with its partner (2i <-> 2i+1 interleaved, j <-> j +- D/2 rotate-half);
    # sign is -1 on the first of each pair.
    row = tl.program_id(0).to(tl.int64)
    n = row % N
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    dm = d < D
    m = (h < H2) & dm
    if INTERLEAVED:
        p = d ^ 1
        first = (d % 2) == 0
    else:
        p = tl.where(d < D // 2, d + D // 2, d - D // 2)
        first = d < D // 2
    base = row * ROW
    x = tl.load(X + base + h * D + d, mask=m, other=0.0).to(tl.float32)
    xp = tl.load(X + base + h * D + p, mask=m, other=0.0).to(tl.float32)
    if BACKWARD:  # in place: every load of the row before any store (partners cross warps)
        tl.debug_barrier()
    patch = n >= NPT
    t = TABLE + (n - NPT) * (2 * D)
    cos = tl.load(t + D + d, mask=dm & patch, other=1.0)
    if BACKWARD:
        sin = tl.load(t + p, mask=dm & patch, other=0.0)
        out = x * cos + tl.where(first, xp, -xp) * sin
    else:
        sin = tl.load(t + d, mask=dm & patch, other=0.0)
        out = x * cos + tl.where(first, -xp, xp) * sin
    tl.store(OUT + base + h * D + d, out.to(OUT.dtype.element_ty), mask=m)
    if COPY_V:
        v = tl.arange(0, BLOCK_V)
        vm = v < HV
        tl.store(OUT + base + H2 * D + v, tl.load(X + base + H2 * D + v, mask=vm), mask=vm)


def rope_packed_qkv(qkv, table, num_prefix_tokens, interleaved, backward=False):
    """timm's RoPE on q and k of a packed ``[B, N, 3, H, D]`` buffer (contiguous), v copied; with
    ``backward`` the transposed rotation in place. ``table``: timm's ``[N - prefix, 2 D]`` sin | cos."""
    B, N, _, H, D = qkv.shape
    out = qkv if backward else torch.empty_like(qkv)
    rope_qk[(B * N,)](qkv, out, table, N, num_prefix_tokens, 3 * H * D, 2 * H, D, H * D,
                      triton.next_power_of_2(2 * H), triton.next_power_of_2(D), triton.next_power_of_2(H * D),
                      interleaved, backward, not backward)
    return out


LEVER43_KERNEL = eva.rope_packed_qkv


def heads(blk, kind, qkv, rope):
    """q, k, v [B, N, H, D] for attention from the QKV GEMM's output [B, N, 3 H D]."""
    if kind in ("packed", "triton"):  # the library's RopeQKV with lever 43's kernel, or with lever 25's
        eva.rope_packed_qkv = LEVER43_KERNEL if kind == "packed" else rope_packed_qkv
        kept, blk.rope_kernel = blk.rope_kernel, "triton"
        q, k, v, _ = blk._qkv_heads(qkv, rope)
        blk.rope_kernel = kept
        return q, k, v
    q, k, v, _ = blk._split_qkv(qkv)
    if kind == "te":
        q, k = blk._rope(q, k, rope)
    return q, k, v


def step(blk, kind, qkv, rope, g):
    qkv = qkv.detach().requires_grad_(True)
    o = blk._impl.attention(blk.attn, *heads(blk, kind, qkv, rope))
    o.backward(g)


def main():
    torch.manual_seed(0)
    print(f"{'shape':16s} {'te ms':>8s} {'triton ms':>9s} {'packed ms':>9s} {'none ms':>8s}   per step (depth blocks): "
          "te - none, triton - none, packed - none, packed - te; max |x - te| / max |te| of the attention "
          "output, x = triton, packed")
    for name, (model, B, img, depth) in SHAPES.items():
        m = timm.create_model(model, pretrained=False, depth=1, img_size=img)
        blk = TE_EvaBlock.from_timm(m.blocks[0], backend="te").cuda().to(torch.bfloat16)
        rope = m.rope.get_embed().cuda()  # [N_patch, 2 D], as Eva hands it to its blocks
        N = rope.shape[0] + blk.cfg.num_prefix_tokens
        A = blk.cfg.num_heads * blk.cfg.head_dim
        qkv = torch.randn(B, N, 3 * A, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(B, N, A, device="cuda", dtype=torch.bfloat16)
        t = {k: per_call_ms(step, blk, k, qkv, rope, g) for k in ("te", "triton", "packed", "none")}
        with torch.no_grad():
            o = {k: blk._impl.attention(blk.attn, *heads(blk, k, qkv, rope)).float() for k in ("te", "triton", "packed")}
        diff = [float((o[k] - o["te"]).abs().max() / o["te"].abs().max()) for k in ("triton", "packed")]
        print(f"{name:16s} {t['te']:8.3f} {t['triton']:9.3f} {t['packed']:9.3f} {t['none']:8.3f}   "
              f"{depth * (t['te'] - t['none']):6.2f} ms, {depth * (t['triton'] - t['none']):6.2f} ms, "
              f"{depth * (t['packed'] - t['none']):6.2f} ms, {depth * (t['packed'] - t['te']):6.2f} ms; "
              f"{diff[0]:.1e}, {diff[1]:.1e}")


def sweep():
    """The library kernel alone at each launch shape: ms per call, forward and backward, and GB/s."""
    import fp8vit._te.kernels as kernels

    default = (kernels._ROPE_ROWS, kernels._ROPE_WARPS)
    print(f"{'shape':16s} {'rows':>4s} {'warps':>5s} {'fwd ms':>7s} {'fwd GB/s':>8s} {'bwd ms':>7s} {'bwd GB/s':>8s}")
    for name, (model, B, img, depth) in SHAPES.items():
        m = timm.create_model(model, pretrained=False, depth=1, img_size=img)
        blk = TE_EvaBlock.from_timm(m.blocks[0], backend="te")
        table = m.rope.get_embed().cuda()
        npt, H, D = blk.cfg.num_prefix_tokens, blk.cfg.num_heads, blk.cfg.head_dim
        qkv = torch.randn(B, table.shape[0] + npt, 3, H, D, device="cuda", dtype=torch.bfloat16)
        interleaved = not blk.cfg.rotate_half
        # bytes: forward reads and writes q, k, v; backward reads and writes q and k (v untouched)
        fwd_gb, bwd_gb = 2 * qkv.nbytes / 1e9, 2 * qkv.nbytes * 2 / 3 / 1e9
        for rows in (1, 2, 4, 8, 16):
            for warps in (4, 8, 16):
                kernels._ROPE_ROWS, kernels._ROPE_WARPS = rows, warps
                try:
                    f = per_call_ms(kernels.rope_packed_qkv, qkv, table, npt, interleaved)
                    b = per_call_ms(lambda: kernels.rope_packed_qkv(qkv, table, npt, interleaved, backward=True))
                except Exception as e:  # a shape Triton cannot compile (registers)
                    print(f"{name:16s} {rows:4d} {warps:5d} failed: {type(e).__name__}: {str(e)[:80]}")
                    continue
                mark = "  (default)" if (rows, warps) == default else ""
                print(f"{name:16s} {rows:4d} {warps:5d} {f:7.3f} {fwd_gb / f * 1e3:8.0f} {b:7.3f} "
                      f"{bwd_gb / b * 1e3:8.0f}{mark}")
        kernels._ROPE_ROWS, kernels._ROPE_WARPS = default


if __name__ == "__main__":
    import sys
    sweep() if "--sweep" in sys.argv[1:] else main()
