"""Lever 57 (docs/performance.md), its microbenchmark: can one Triton launch cast every GEMM weight
of a ViT to FP8 (with the transpose and the amax, as TE's delayed-scaling weight cast) faster than
TE's one kernel per weight?

    python3 docs/perf/weight_cast_bench.py     # on the GPU machine, TE installed

Why: a graphed step casts each fp32 weight inside the forward graph, one TE
``cast_transpose_optimized_kernel`` per weight (qkv, proj, fc1, fc2 of each block). The H100 sync
profiles (``results/profile/*_sync_h100.kernels.txt``) give ViT-B 48 calls, 0.425 ms, and ViT-L 96
calls, 1.318 ms: about 1.2-1.4 TB/s for 6 bytes a parameter (fp32 in, the cast and its transpose
out), where TE's activation casts move 2.2-2.4. Small launches (a 768 x 768 weight is 3.5 MB of
traffic) pay their ramp and tail each. One launch over all weights' tiles (a table of weight,
tile row, tile column; pointers read from device tables) pays them once.

Each weight here gets its own delayed-scaling quantizer (E4M3, a scale, an amax), as in TE's
modules; the Triton pass's bytes, amax and scale_inv are checked against TE's for every weight.
Times: 20 back-to-back calls of the whole model's casts captured in a CUDA graph, median of 30
replays, divided by 20 (``microbench.per_call_ms``).

Prediction (written before the first run): TE's casts per step ViT-B 0.38-0.45 ms, ViT-L 1.2-1.4,
ViT-H 2.0-2.6 (as the profiles); the best Triton configuration >= 2.0 TB/s: ViT-B -0.15 to -0.25 ms,
ViT-L -0.4 to -0.7, ViT-H -0.7 to -1.1 per step. Below -0.1 ms at ViT-B the lever is dropped
(building it means TE's modules reading a workspace the graph fills: ``is_first_microbatch=False``).
"""

import functools

import fp8vit  # noqa: F401  imports TE (where installed) before torch runs a cuDNN kernel
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from fp8vit._te import te_module, te_version
from microbench import VIT_WIDTHS as MODELS, per_call_ms

CONFIGS = ((32, 64, 4), (64, 64, 4), (64, 128, 4), (128, 64, 4), (64, 64, 2), (128, 128, 8))  # rows, cols, warps
FP8_MAX = 448.0  # E4M3, the weights' format under delayed scaling


@triton.jit
def weights_cast_transpose(TILES, SRC, DST, DST_T, ROWS, COLS, SCALE, AMAX, SCALE_INV,
                           FP8_MAX: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # One program: one BLOCK_R x BLOCK_C tile of one weight. TILES [T, 3] int32: the weight's index,
    # the tile's row and column; SRC, DST, DST_T, SCALE, AMAX, SCALE_INV: int64 device addresses per
    # weight (fp32 [R, C] in; its FP8 cast [R, C] and transpose [C, R] out, as uint8 bytes; the
    # quantizer's scale, amax and scale_inv). The cast is x * scale saturated to the format's range and
    # rounded to nearest, as TE's; the amax is max |x| (atomic max into the delayed-scaling history).
    pid = tl.program_id(0)
    w = tl.load(TILES + pid * 3)
    tr = tl.load(TILES + pid * 3 + 1)
    tc = tl.load(TILES + pid * 3 + 2)
    R = tl.load(ROWS + w)
    C = tl.load(COLS + w)
    src = tl.load(SRC + w).to(tl.pointer_type(tl.float32))
    dst = tl.load(DST + w).to(tl.pointer_type(tl.uint8))
    dst_t = tl.load(DST_T + w).to(tl.pointer_type(tl.uint8))
    scale_p = tl.load(SCALE + w).to(tl.pointer_type(tl.float32))
    amax_p = tl.load(AMAX + w).to(tl.pointer_type(tl.float32))
    scale = tl.load(scale_p)
    rows = tr * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tc * BLOCK_C + tl.arange(0, BLOCK_C)
    m = (rows[:, None] < R) & (cols[None, :] < C)
    offs = rows[:, None].to(tl.int64) * C + cols[None, :]
    x = tl.load(src + offs, mask=m, other=0.0)
    y = x * scale
    y = tl.where(y > FP8_MAX, FP8_MAX, tl.where(y < -FP8_MAX, -FP8_MAX, y))  # NaN stays NaN
    q = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    tl.store(dst + offs, q, mask=m)
    tl.store(dst_t + cols[None, :].to(tl.int64) * R + rows[:, None], q, mask=m)
    tl.atomic_max(amax_p, tl.max(tl.max(tl.abs(x), axis=1), axis=0))
    if (tr == 0) & (tc == 0):
        inv_p = tl.load(SCALE_INV + w).to(tl.pointer_type(tl.float32))
        tl.store(inv_p, libdevice.div_rn(scale * 0.0 + 1.0, scale))  # exact, as TE's


def weight_shapes(width, depth):
    """``[N, K]`` of each GEMM weight of a pre-norm ViT block (MLP ratio 4), ``depth`` times."""
    return [(3 * width, width), (width, width), (4 * width, width), (width, 4 * width)] * depth


@functools.lru_cache(maxsize=None)
def _fp8_types():
    tex = te_module("transformer_engine_torch")
    return tex, te_module("transformer_engine.pytorch.tensor.float8_tensor").Float8Quantizer


def quantizer():
    tex, f8 = _fp8_types()
    q = f8(scale=torch.tensor([300.0], device="cuda"), amax=torch.zeros(1, device="cuda"),
           fp8_dtype=tex.DType.kFloat8E4M3)
    q.set_usage(rowwise=True, columnwise=True)
    return q


class TritonCasts:
    """One launch casting every weight into its own Float8 tensor (made by its quantizer)."""

    def __init__(self, weights, quantizers, block_r, block_c, warps):
        self.outs = [q.make_empty(w.shape, dtype=torch.bfloat16, device=w.device) for w, q in zip(weights, quantizers)]
        tiles = [(i, r, c) for i, w in enumerate(weights)
                 for r in range(triton.cdiv(w.shape[0], block_r)) for c in range(triton.cdiv(w.shape[1], block_c))]
        dev = weights[0].device

        def addresses(ts):
            return torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=dev)
        self.tiles = torch.tensor(tiles, dtype=torch.int32, device=dev)
        self.src = addresses(weights)
        self.dst, self.dst_t = addresses([o._data for o in self.outs]), addresses([o._transpose for o in self.outs])
        self.rows = torch.tensor([w.shape[0] for w in weights], dtype=torch.int32, device=dev)
        self.cols = torch.tensor([w.shape[1] for w in weights], dtype=torch.int32, device=dev)
        self.scale, self.amax = addresses([q.scale for q in quantizers]), addresses([q.amax for q in quantizers])
        self.scale_inv = addresses([o._scale_inv for o in self.outs])
        self.grid, self.cfg, self.warps = (len(tiles),), (block_r, block_c), warps

    def __call__(self):
        weights_cast_transpose[self.grid](self.tiles, self.src, self.dst, self.dst_t, self.rows, self.cols,
                                          self.scale, self.amax, self.scale_inv, FP8_MAX, *self.cfg,
                                          num_warps=self.warps)
        return self.outs


def same(got, ref, got_q, ref_q):
    """Every weight's cast and transpose byte for byte as TE's, its amax and scale_inv equal."""
    return all(torch.equal(g._data, r._data) and torch.equal(g._transpose, r._transpose)
               and torch.equal(g._scale_inv, r._scale_inv) and torch.equal(gq.amax, rq.amax)
               for g, r, gq, rq in zip(got, ref, got_q, ref_q))


def main():
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, TE {te_version()}, triton {triton.__version__}")
    for model, (width, depth) in MODELS.items():
        shapes = weight_shapes(width, depth)
        weights = [torch.randn(s, device="cuda") * 0.02 for s in shapes]
        moved = sum(w.numel() for w in weights) * 6  # fp32 in, two FP8 out
        te_q = [quantizer() for _ in weights]

        def te_casts():  # what a graphed forward runs: one TE cast (with its transpose) per weight
            return [q(w) for q, w in zip(te_q, weights)]
        ref = te_casts()
        te_ms = per_call_ms(te_casts)
        print(f"{model}: {len(weights)} weights, {moved / 1e6:.0f} MB moved; TE one cast each "
              f"{te_ms * 1e3:.1f} us ({moved / te_ms / 1e6:.0f} GB/s)")
        rows = []
        for block_r, block_c, warps in CONFIGS:
            qs = [quantizer() for _ in weights]
            try:
                casts = TritonCasts(weights, qs, block_r, block_c, warps)
                ok = same(casts(), ref, qs, te_q)
                ms = per_call_ms(casts)
            except Exception as err:  # a shape Triton cannot compile (registers, shared memory)
                print(f"  {(block_r, block_c, warps)}: {type(err).__name__}: {str(err)[:160]}")
                continue
            rows.append((ms, (block_r, block_c, warps), ok))
        for ms, cfg, ok in sorted(rows):
            print(f"    {ms * 1e3:7.1f} us {moved / ms / 1e6:6.0f} GB/s  {cfg} (rows, cols, warps)  "
                  f"{'same as TE' if ok else 'DIFFERS'}  {(ms - te_ms) * 1e3:+.1f} us against TE")
        best = min((ms for ms, _, ok in rows if ok), default=te_ms)
        print(f"{model} per step: TE {te_ms:.3f} ms, fastest correct Triton {best:.3f} ms, difference {best - te_ms:+.3f} ms")


if __name__ == "__main__":
    main()
