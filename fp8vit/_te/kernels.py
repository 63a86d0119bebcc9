"""Triton kernels for the elementwise work of a training step that torch runs as several passes.

- LayerScale's forward and backward (:func:`column_scale_add`, :func:`layerscale_backward`), for
  :class:`fp8vit.blocks.base.LayerScaleAdd`;
- drop path's per-sample scale with the residual add (:func:`row_scale_add`), for
  :class:`fp8vit.blocks.base.DropPathAdd`;
- the norm over the real units of a padded MLP's hidden layer (:func:`padded_norm_forward`,
  :func:`padded_norm_backward`), for :class:`fp8vit.blocks.mlp.PaddedNorm`;
- RoPE on q and k of the packed QKV buffer (:func:`rope_packed_qkv`), for
  :class:`fp8vit.blocks.eva.RopeQKV`;
- an output gradient's FP8 cast, its transpose and its column sums (the bias gradient)
  (:func:`cast_transpose_dbias`), for :mod:`fp8vit._te.bias_grad`;
- the LayerNorm backward with the residual stream's gradient added (:func:`layernorm_backward_add`),
  for :mod:`fp8vit._te.norm_grad`.

Each takes contiguous tensors in one half-precision dtype on one GPU (:func:`kernel_takes`).
Triton comes with torch's CUDA wheels; it is imported on first use on a CUDA tensor only, so that
``import fp8vit`` stays light and CPU-only installs never touch it. Where it cannot run, the
callers keep their torch expression (:func:`triton_support` says why). ``FP8VIT_TRITON=0`` turns
the kernels off (for a cluster whose Triton cannot compile: it needs a C compiler and a writable
cache).
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace
from typing import Optional, Tuple

import torch

from ..errors import Check

__all__ = ["triton_support", "kernel_takes", "layerscale_backward", "row_scale_add", "column_scale_add",
           "padded_norm_forward", "padded_norm_backward", "rope_support", "rope_packed_qkv", "cast_transpose_dbias",
           "layernorm_backward_add"]


@functools.lru_cache(maxsize=None)
def triton_support() -> Check:
    """Whether fp8vit's Triton kernels can run here (a CUDA device, Triton importable, not turned
    off by ``FP8VIT_TRITON=0``). Cached; ``fp8vit.clear_cache()`` forgets it."""
    if os.environ.get("FP8VIT_TRITON", "1") == "0":
        return Check(False, "turned off by FP8VIT_TRITON=0")
    if not torch.cuda.is_available():
        return Check(False, "no CUDA device")
    try:
        _kernels()
    except Exception as e:  # ImportError, or a Triton that fails to set up
        return Check(False, f"importing triton failed with {type(e).__name__}: {e}; "
                            "install the triton that matches torch (it ships with torch's CUDA wheels)")
    try:  # Triton compiles on first launch (a C compiler builds its launcher): launch each kernel now
        g = torch.zeros(2, 16, device="cuda", dtype=torch.bfloat16)
        layerscale_backward(g, g, g[0])
        row_scale_add(g, g, g[:, :1].contiguous())
        column_scale_add(g, g, g[0])
        y, mean, rstd = padded_norm_forward(g, 15, g[0, :15].float(), None, 1e-6, rms=False)
        padded_norm_backward(g, g, g[0, :15].float(), mean, rstd, 15, has_bias=False, rms=False)
    except Exception as e:
        return Check(False, f"Triton is installed but its first kernel failed with {type(e).__name__}: {e}; "
                            "fix the Triton setup (a C compiler, a writable ~/.triton cache) or set FP8VIT_TRITON=0")
    return Check(True)


def kernel_takes(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether fp8vit's elementwise kernels take these tensors (None: an absent one): on one CUDA
    device, contiguous, one half-precision dtype, and Triton runs here (:func:`triton_support`).
    Shapes are the caller's to check."""
    ts = [t for t in tensors if t is not None]
    first = ts[0]
    return (first.is_cuda and first.dtype in (torch.bfloat16, torch.float16)
            and all(t.device == first.device and t.dtype == first.dtype and t.is_contiguous() for t in ts)
            and triton_support().ok)


@functools.lru_cache(maxsize=None)
def _kernels():
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    @triton.jit
    def layerscale_bwd(G, Y, GAMMA, DY, PART, R, C, ROWS_PER_PROG, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        # One program: ROWS_PER_PROG rows x BLOCK_C columns of g and y [R, C] (the sizes are runtime
        # arguments: one compiled kernel serves every batch shape). Stores dy = g * gamma
        # and sum over its rows of g * y (fp32: each product of two bf16 values is exact) in
        # PART[program row, columns].
        pid_r = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < C
        gamma = tl.load(GAMMA + cols, mask=cmask, other=0.0).to(tl.float32)
        acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
        for r in range(0, ROWS_PER_PROG, BLOCK_R):
            rows = pid_r * ROWS_PER_PROG + r + tl.arange(0, BLOCK_R)
            m = (rows[:, None] < R) & cmask[None, :]
            offs = rows[:, None].to(tl.int64) * C + cols[None, :]
            g = tl.load(G + offs, mask=m, other=0.0).to(tl.float32)
            y = tl.load(Y + offs, mask=m, other=0.0).to(tl.float32)
            tl.store(DY + offs, (g * gamma[None, :]).to(DY.dtype.element_ty), mask=m)
            acc += g * y
        tl.store(PART + pid_r * C + cols, tl.sum(acc, axis=0), mask=cmask)

    @triton.jit
    def row_scale_add_kernel(X, Y, M, OUT, N, PER, HAS_X: tl.constexpr, BY_COLUMN: tl.constexpr,
                             BLOCK: tl.constexpr):
        # OUT = X + Y * M[i] (or Y * M[i] without X) over N elements of contiguous tensors, i the
        # element's row (element // PER: [S, ...] with one value per leading row) or, BY_COLUMN,
        # its column (element % PER: [..., C] with one value per column, LayerScale's gamma): one
        # fp32 multiply-add per element, rounded once, as torch's addcmul and mul compute it.
        # Contiguous loads and stores (torch runs a broadcast operand in its non-vectorized kernel).
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < N
        if BY_COLUMN:
            idx = offs % PER
        else:
            idx = offs // PER
        scale = tl.load(M + idx, mask=m, other=0.0).to(tl.float32)
        r = tl.load(Y + offs, mask=m, other=0.0).to(tl.float32) * scale
        if HAS_X:
            r += tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(OUT + offs, r.to(OUT.dtype.element_ty), mask=m)

    @triton.jit
    def padded_norm_fwd(X, W, B, Y, MEAN, RSTD, H, HP, eps, HAS_B: tl.constexpr, RMS: tl.constexpr,
                        BLOCK: tl.constexpr):
        # One program per row of X [R, HP]: LayerNorm (or RMSNorm) over its first H columns with
        # fp32 statistics, Y = xhat * W (+ B) there and exactly 0 in columns H..HP-1.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        real = cols < H
        # whole rows of HP columns (vectorized loads; a mask at H < HP would split them), the
        # padding then zeroed: it may hold act(0) != 0
        x = tl.where(real, tl.load(X + row * HP + cols, mask=cols < HP, other=0.0).to(tl.float32), 0.0)
        if RMS:
            xc = x
        else:
            mean = tl.sum(x, axis=0) / H
            xc = tl.where(real, x - mean, 0.0)
            tl.store(MEAN + row, mean)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / H + eps)
        tl.store(RSTD + row, rstd)
        y = xc * rstd * tl.load(W + cols, mask=real, other=0.0).to(tl.float32)
        if HAS_B:
            y += tl.load(B + cols, mask=real, other=0.0).to(tl.float32)
        tl.store(Y + row * HP + cols, tl.where(real, y, 0.0).to(Y.dtype.element_ty), mask=cols < HP)

    @triton.jit
    def padded_norm_bwd(G, X, W, MEAN, RSTD, DX, PART_W, PART_B, R, H, HP, ROWS_PER_PROG,
                        HAS_B: tl.constexpr, RMS: tl.constexpr, BLOCK: tl.constexpr):
        # One program: a strip of ROWS_PER_PROG rows. DX over the first H columns (the norm's
        # backward, fp32), 0 in the padding; the strip's sums of G * xhat (and G) in PART_W (PART_B).
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        real = cols < H
        w = tl.load(W + cols, mask=real, other=0.0).to(tl.float32)
        acc_w = tl.zeros((BLOCK,), dtype=tl.float32)
        acc_b = tl.zeros((BLOCK,), dtype=tl.float32)
        for i in range(0, ROWS_PER_PROG):
            row = pid * ROWS_PER_PROG + i
            if row < R:
                base = row.to(tl.int64) * HP
                x = tl.where(real, tl.load(X + base + cols, mask=cols < HP, other=0.0).to(tl.float32), 0.0)
                g = tl.where(real, tl.load(G + base + cols, mask=cols < HP, other=0.0).to(tl.float32), 0.0)
                rstd = tl.load(RSTD + row)
                if RMS:
                    xhat = x * rstd
                else:
                    xhat = tl.where(real, (x - tl.load(MEAN + row)) * rstd, 0.0)
                gw = g * w
                c2 = tl.sum(gw * xhat, axis=0) / H
                if RMS:
                    dx = (gw - xhat * c2) * rstd
                else:
                    dx = (gw - tl.sum(gw, axis=0) / H - xhat * c2) * rstd
                tl.store(DX + base + cols, tl.where(real, dx, 0.0).to(DX.dtype.element_ty), mask=cols < HP)
                acc_w += g * xhat
                if HAS_B:
                    acc_b += g
        tl.store(PART_W + pid * H + cols, acc_w, mask=real)
        if HAS_B:
            tl.store(PART_B + pid * H + cols, acc_b, mask=real)

    @triton.jit
    def rope_qk(X, OUT, TABLE, R, N, NPT, H2, V, D: tl.constexpr, HALF: tl.constexpr, BLOCK_T: tl.constexpr,
                BLOCK_H: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_V: tl.constexpr, INTERLEAVED: tl.constexpr,
                BACKWARD: tl.constexpr):
        # One program: BLOCK_T token rows of the packed buffer X [R = B N, 3, H, D], a row being q and
        # k (H2 = 2H heads of D channels) then v (V = H D elements). Channels pair up as (a, b): (2j,
        # 2j + 1) interleaved, (j, j + D/2) rotate-half, j < HALF = D/2; timm's rot(x) is -x_b at a
        # and x_a at b in both. Every load and store is of contiguous channels (vectorized). TABLE
        # [N - NPT, 2D] fp32 is timm's sin | cos per patch token; the NPT prefix tokens of each image
        # get cos 1, sin 0 (an exact copy).
        #   forward   out_a = x_a cos_a - x_b sin_a,  out_b = x_b cos_b + x_a sin_b   (+ v copied)
        #   backward  dx_a = g_a cos_a + g_b sin_b,   dx_b = g_b cos_b - g_a sin_a   (its transpose,
        #             in place in X: each pair is loaded and stored by the same thread)
        # fp32 arithmetic, one rounding per output, as timm's expression under autocast.
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [T]
        live = rows < R
        n = rows % N
        patch = live & (n >= NPT)
        base = rows.to(tl.int64) * (H2 * D + V)
        h = tl.arange(0, BLOCK_H)
        t = TABLE + (n - NPT).to(tl.int64)[:, None] * (2 * D)  # [T, 1]; read for patch tokens only
        heads = X + base[:, None, None] + (h * D)[None, :, None]
        out = OUT + base[:, None, None] + (h * D)[None, :, None]
        if INTERLEAVED:  # whole rows of D channels (contiguous loads), the pairs split in registers
            d = tl.arange(0, 2 * BLOCK_J)
            m = live[:, None, None] & (h < H2)[None, :, None] & (d < D)[None, None, :]
            xa, xb = tl.split(tl.reshape(tl.load(heads + d[None, None, :], mask=m, other=0.0).to(tl.float32),
                                         (BLOCK_T, BLOCK_H, BLOCK_J, 2)))
            tm = patch[:, None] & (d < D)[None, :]
            sin_a, sin_b = tl.split(tl.reshape(tl.load(t + d[None, :], mask=tm, other=0.0), (BLOCK_T, BLOCK_J, 2)))
            cos_a, cos_b = tl.split(tl.reshape(tl.load(t + D + d[None, :], mask=tm, other=1.0), (BLOCK_T, BLOCK_J, 2)))
        else:  # rotate-half: the two halves of each head, each contiguous
            j = tl.arange(0, BLOCK_J)  # BLOCK_J = HALF where D/2 is a power of two (D = 64, 128)
            m = live[:, None, None] & (h < H2)[None, :, None] & (j < HALF)[None, None, :]
            xa = tl.load(heads + j[None, None, :], mask=m, other=0.0).to(tl.float32)
            xb = tl.load(heads + HALF + j[None, None, :], mask=m, other=0.0).to(tl.float32)
            tm = patch[:, None] & (j < HALF)[None, :]
            sin_a = tl.load(t + j[None, :], mask=tm, other=0.0)
            sin_b = tl.load(t + HALF + j[None, :], mask=tm, other=0.0)
            cos_a = tl.load(t + D + j[None, :], mask=tm, other=1.0)
            cos_b = tl.load(t + D + HALF + j[None, :], mask=tm, other=1.0)
        sin_a, sin_b, cos_a, cos_b = sin_a[:, None, :], sin_b[:, None, :], cos_a[:, None, :], cos_b[:, None, :]
        if BACKWARD:
            oa = xa * cos_a + xb * sin_b
            ob = xb * cos_b - xa * sin_a
            tl.debug_barrier()  # in place: every load of the tile before the first store
        else:
            oa = xa * cos_a - xb * sin_a
            ob = xb * cos_b + xa * sin_b
        oa, ob = oa.to(OUT.dtype.element_ty), ob.to(OUT.dtype.element_ty)
        if INTERLEAVED:
            tl.store(out + d[None, None, :], tl.reshape(tl.join(oa, ob), (BLOCK_T, BLOCK_H, 2 * BLOCK_J)), mask=m)
        else:
            tl.store(out + j[None, None, :], oa, mask=m)
            tl.store(out + HALF + j[None, None, :], ob, mask=m)
        if not BACKWARD:
            v = tl.arange(0, BLOCK_V)
            vm = live[:, None] & (v < V)[None, :]
            vo = base[:, None] + H2 * D + v[None, :]
            tl.store(OUT + vo, tl.load(X + vo, mask=vm), mask=vm)

    @triton.jit
    def cast_transpose_dbias_kernel(G, Q, QT, PART, SCALE, AMAX, SCALE_INV, R, C, ROWS_PER_PROG,
                                    FP8_MAX: tl.constexpr, E5M2: tl.constexpr, BLOCK_R: tl.constexpr,
                                    BLOCK_C: tl.constexpr):
        # One program: ROWS_PER_PROG rows x BLOCK_C columns of G [R, C], x = G in fp32; Q [R, C] and
        # QT [C, R] get x * scale in FP8 (saturated, rounded to nearest, as TE's casts), PART[program
        # row] the strip's column sums of x, AMAX the largest |x| (atomic max into the delayed-scaling
        # history), SCALE_INV 1 / scale. The sums and the amax stay per element in registers until
        # the strip ends: reducing across the tile every BLOCK_R rows halved the bandwidth (lever 48).
        pid_r = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < C
        scale = tl.load(SCALE)
        acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
        amax = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
        for r in range(0, ROWS_PER_PROG, BLOCK_R):
            rows = pid_r * ROWS_PER_PROG + r + tl.arange(0, BLOCK_R)
            m = (rows[:, None] < R) & cmask[None, :]
            offs = rows[:, None].to(tl.int64) * C + cols[None, :]
            x = tl.load(G + offs, mask=m, other=0.0).to(tl.float32)
            acc += x
            amax = tl.maximum(amax, tl.abs(x))
            y = x * scale
            y = tl.where(y > FP8_MAX, FP8_MAX, tl.where(y < -FP8_MAX, -FP8_MAX, y))  # NaN stays NaN
            if E5M2:
                q = y.to(tl.float8e5).to(tl.uint8, bitcast=True)
            else:
                q = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            tl.store(Q + offs, q, mask=m)
            tl.store(QT + cols[None, :].to(tl.int64) * R + rows[:, None], q, mask=m)  # Triton stages it
        tl.store(PART + pid_r * C + cols, tl.sum(acc, axis=0), mask=cmask)
        tl.atomic_max(AMAX, tl.max(tl.max(amax, axis=1), axis=0))
        if (pid_r == 0) & (tl.program_id(1) == 0):
            tl.store(SCALE_INV, libdevice.div_rn(scale * 0.0 + 1.0, scale))  # exact, as TE's

    @triton.jit
    def ln_bwd_add(DZ, X, MU, RS, W, G, DX, PART_W, PART_B, R, C, ROWS_PER_PROG, BLOCK_R: tl.constexpr,
                   CP: tl.constexpr):
        # One program: a strip of ROWS_PER_PROG rows of the [R, C] tensors, BLOCK_R whole rows at a
        # time (CP: C's next power of two; a tile of rows keeps enough loads in flight, where one row
        # at a time ran at half TE's speed: lever 51). xhat = (x - mu) * rs, dy = dz * w:
        #   DX = (dy - mean(dy) - xhat * mean(dy * xhat)) * rs + G   (fp32, rounded once)
        # and the strip's column sums of dz * xhat (dgamma) and dz (dbeta) into PART_W / PART_B.
        pid = tl.program_id(0)
        cols = tl.arange(0, CP)
        cm = cols < C
        w = tl.load(W + cols, mask=cm, other=0.0).to(tl.float32)
        acc_w = tl.zeros((BLOCK_R, CP), dtype=tl.float32)
        acc_b = tl.zeros((BLOCK_R, CP), dtype=tl.float32)
        for r in range(0, ROWS_PER_PROG, BLOCK_R):
            rows = pid * ROWS_PER_PROG + r + tl.arange(0, BLOCK_R)
            live = rows < R
            m = live[:, None] & cm[None, :]
            offs = rows[:, None].to(tl.int64) * C + cols[None, :]
            dz = tl.load(DZ + offs, mask=m, other=0.0).to(tl.float32)
            x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
            g = tl.load(G + offs, mask=m, other=0.0).to(tl.float32)
            mu = tl.load(MU + rows, mask=live, other=0.0)
            rs = tl.load(RS + rows, mask=live, other=0.0)
            xhat = tl.where(m, (x - mu[:, None]) * rs[:, None], 0.0)
            dy = dz * w[None, :]
            c1 = tl.sum(dy, axis=1) / C
            c2 = tl.sum(dy * xhat, axis=1) / C
            dx = (dy - c1[:, None] - xhat * c2[:, None]) * rs[:, None] + g
            tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=m)
            acc_w += dz * xhat
            acc_b += dz
        tl.store(PART_W + pid * C + cols, tl.sum(acc_w, axis=0), mask=cm)
        tl.store(PART_B + pid * C + cols, tl.sum(acc_b, axis=0), mask=cm)

    @triton.jit
    def column_sum(PART, OUT, P, C, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
        # OUT[c] = sum over the P rows of PART [P, C] (fp32), rounded once to OUT's dtype
        cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < C
        acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)
        for p in range(0, P, BLOCK_P):
            rows = p + tl.arange(0, BLOCK_P)
            acc += tl.load(PART + rows[:, None] * C + cols[None, :], mask=(rows[:, None] < P) & cmask[None, :], other=0.0)
        tl.store(OUT + cols, tl.sum(acc, axis=0).to(OUT.dtype.element_ty), mask=cmask)

    return SimpleNamespace(triton=triton, layerscale_bwd=layerscale_bwd, row_scale_add=row_scale_add_kernel,
                           padded_norm_fwd=padded_norm_fwd, padded_norm_bwd=padded_norm_bwd, rope_qk=rope_qk,
                           cast_transpose_dbias=cast_transpose_dbias_kernel, column_sum=column_sum,
                           ln_bwd_add=ln_bwd_add)


_BLOCK_R, _BLOCK_C = 32, 128
_BLOCK_ROW_SCALE = 2048


def layerscale_backward(grad: torch.Tensor, y: torch.Tensor, gamma: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The input gradients of ``x + gamma * y`` with respect to ``y`` and ``gamma``, in one pass.

    Reads ``grad`` and ``y`` once and writes ``dy`` once, where torch's ``grad * gamma`` and
    ``(grad * y).sum`` read ``grad`` twice and write and re-read the product (6 passes over
    ``[..., C]`` against 3; docs/performance.md, lever 24).

    Args:
        grad: the output gradient ``[..., C]``, CUDA, bf16 or fp16.
        y: the branch output ``[..., C]``, ``grad``'s shape and dtype.
        gamma: ``[C]`` in ``grad``'s dtype (as the forward used it).

    Returns:
        ``dy = grad * gamma`` (``grad``'s dtype, bit-identical to torch's product) and ``dgamma``
        ``[C]`` fp32, the column sums of ``grad * y`` with each product exact.
    """
    k = _kernels()
    triton, kernel = k.triton, k.layerscale_bwd
    C = grad.shape[-1]
    g2, y2 = grad.reshape(-1, C).contiguous(), y.reshape(-1, C).contiguous()
    R = g2.shape[0]
    if not R:  # an empty batch or shard
        return torch.empty_like(grad), torch.zeros(C, device=grad.device, dtype=torch.float32)
    col_blocks = triton.cdiv(C, _BLOCK_C)
    row_progs, rows_per_prog = _row_strips(R, grad.device, col_blocks, _BLOCK_R)
    dy = torch.empty_like(g2)
    part = torch.empty(row_progs, C, device=grad.device, dtype=torch.float32)
    with torch.cuda.device(grad.device):  # Triton launches on the current device
        kernel[(row_progs, col_blocks)](g2, y2, gamma.contiguous(), dy, part, R, C, rows_per_prog, _BLOCK_R, _BLOCK_C)
    return dy.view(grad.shape), part.sum(0)


def _row_strips(rows: int, device: torch.device, column_programs: int = 1, multiple: int = 1,
                per_sm: int = 4) -> Tuple[int, int]:
    """``(programs, rows per program)`` for a kernel whose programs each sum a strip of ``rows > 0``
    rows (times ``column_programs`` programs across the columns): about ``per_sm`` programs per
    SM, enough to fill the GPU, few enough that the partial sums ``[programs, columns]`` stay
    small; strips a multiple of ``multiple`` rows (the kernel's row tile)."""
    import triton
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    progs = max(1, min(triton.cdiv(rows, multiple), per_sm * sms // column_programs))
    per = triton.cdiv(triton.cdiv(rows, progs), multiple) * multiple
    return triton.cdiv(rows, per), per


def row_scale_add(x: Optional[torch.Tensor], y: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x + y * scale`` (or ``y * scale`` for ``x`` None) with one ``scale`` value per leading row:
    drop path's per-sample mask and the residual add in one contiguous pass.

    Args:
        x: the residual stream ``[S, ...]``, ``y``'s shape and dtype, contiguous; or None.
        y: the branch output ``[S, ...]``, CUDA, contiguous.
        scale: ``[S, 1, ..., 1]`` (``y``'s number of dimensions), contiguous, on ``y``'s device.

    Returns:
        a new tensor in ``y``'s dtype: ``x + y * scale[s]`` per element of row ``s``, computed in fp32
        and rounded once (torch's ``addcmul`` and ``mul``).
    """
    return _scale_add(x, y, scale, y.numel() // y.shape[0] if y.numel() else 1, by_column=False)


def column_scale_add(x: torch.Tensor, y: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """``x + y * gamma`` with ``gamma`` ``[C]`` one value per column of ``y`` ``[..., C]``
    (LayerScale's forward), in one contiguous pass: as :func:`row_scale_add`, the same fp32
    arithmetic as torch's ``addcmul``, which runs the broadcast ``gamma`` in its non-vectorized
    kernel. ``x``, ``y``: CUDA, contiguous, one dtype; ``gamma``: contiguous, on their device."""
    return _scale_add(x, y, gamma, y.shape[-1], by_column=True)


def _scale_add(x: Optional[torch.Tensor], y: torch.Tensor, scale: torch.Tensor, per: int,
               by_column: bool) -> torch.Tensor:
    k = _kernels()
    n = y.numel()
    out = torch.empty_like(y)
    if n:
        with torch.cuda.device(y.device):  # Triton launches on the current device
            k.row_scale_add[(k.triton.cdiv(n, _BLOCK_ROW_SCALE),)](y if x is None else x, y, scale, out, n, per,
                                                                  x is not None, by_column, _BLOCK_ROW_SCALE)
    return out


def _norm_launch(hp: int) -> Tuple[int, int]:
    """(BLOCK, num_warps) for rows of ``hp`` columns: one row per block of registers."""
    import triton
    block = triton.next_power_of_2(hp)
    return block, (4 if block <= 1024 else 8 if block <= 4096 else 16)


def padded_norm_forward(h: torch.Tensor, real: int, weight: torch.Tensor, bias: Optional[torch.Tensor],
                        eps: float, rms: bool,
                        out_dtype: Optional[torch.dtype] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LayerNorm (or RMSNorm, ``rms``) over the first ``real`` of the ``Hp`` columns of ``h``, the
    rest of the output exactly 0: a padded MLP's inner norm (:mod:`fp8vit.blocks.mlp`) in one pass,
    where torch slices, copies the slice to normalize it and pads the result again.

    Args:
        h: ``[..., Hp]``, CUDA, contiguous (bf16, fp16 or fp32).
        real: ``H <= Hp``, the columns normalized.
        weight, bias: ``[H]`` (bias None: none, as RMSNorm), any float dtype; used in fp32.
        eps: the norm's epsilon.
        rms: RMSNorm (no mean) instead of LayerNorm.
        out_dtype: the output's dtype (None: ``h``'s); fp32 gives autocast's norm output unrounded.

    Returns:
        the output (``h``'s shape, ``out_dtype``), and each row's mean (LayerNorm) and 1 / std, fp32 ``[R]``.
    """
    k = _kernels()
    hp = h.shape[-1]
    h2 = h.reshape(-1, hp)
    rows = h2.shape[0]
    y = torch.empty(h2.shape, device=h.device, dtype=out_dtype or h.dtype)
    mean = torch.empty(rows, device=h.device, dtype=torch.float32)
    rstd = torch.empty_like(mean)
    block, warps = _norm_launch(hp)
    if rows:
        with torch.cuda.device(h.device):  # Triton launches on the current device
            k.padded_norm_fwd[(rows,)](h2, weight, weight if bias is None else bias, y, mean, rstd, real, hp, eps,
                                       bias is not None, rms, block, num_warps=warps)
    return y.view(h.shape), mean, rstd


def padded_norm_backward(grad: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor,
                         rstd: torch.Tensor, real: int, has_bias: bool,
                         rms: bool) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The gradients of :func:`padded_norm_forward`: ``dh`` (``h``'s shape and dtype, 0 in the
    padding), and fp32 ``dweight`` ``[H]`` and ``dbias`` (None without a bias), summed over rows in
    fp32. ``grad`` (the output's dtype) and ``h``: ``[..., Hp]``, contiguous."""
    k = _kernels()
    hp = h.shape[-1]
    g2, h2 = grad.reshape(-1, hp), h.reshape(-1, hp)
    rows = h2.shape[0]
    dh = torch.empty_like(h2)
    if not rows:  # nothing to normalize (an empty batch or shard)
        zero = torch.zeros(real, device=h.device, dtype=torch.float32)
        return dh.view(h.shape), zero, (zero.clone() if has_bias else None)
    progs, per = _row_strips(rows, h.device)
    part_w = torch.empty(progs, real, device=h.device, dtype=torch.float32)  # every program writes its row
    part_b = torch.empty(progs, real, device=h.device, dtype=torch.float32) if has_bias else part_w
    block, warps = _norm_launch(hp)
    with torch.cuda.device(h.device):
        k.padded_norm_bwd[(progs,)](g2, h2, weight, mean, rstd, dh, part_w, part_b, rows, real, hp, per,
                                    has_bias, rms, block, num_warps=warps)
    return dh.view(h.shape), part_w.sum(0), (part_b.sum(0) if has_bias else None)


@functools.lru_cache(maxsize=None)
def rope_support(interleaved: bool, dtype: torch.dtype) -> Check:
    """Whether :func:`rope_packed_qkv` runs here for this pairing and dtype: Triton runs
    (:func:`triton_support`) and the kernel's forward and backward compile and launch (checked
    once, on a tiny buffer, by the first RoPE block that asks: models without RoPE never compile
    it). Cached; ``fp8vit.clear_cache()`` forgets it."""
    ok = triton_support()
    if not ok.ok:
        return ok
    try:
        qkv = torch.zeros(1, 2, 3, 1, 4, device="cuda", dtype=dtype)
        table = torch.zeros(1, 8, device="cuda")
        rope_packed_qkv(qkv, table, 1, interleaved)
        rope_packed_qkv(qkv, table, 1, interleaved, backward=True)
    except Exception as e:
        return Check(False, f"fp8vit's RoPE kernel failed to compile or run ({'interleaved' if interleaved else 'rotate-half'}, "
                            f"{dtype}) with {type(e).__name__}: {e}")
    return Check(True)


# Token rows per program of rope_qk: 4 rows of q and k at ViT-B/L widths (2H x D/2 fp32 pairs: 32
# registers a thread at 8 warps), several thousand programs per step
_ROPE_ROWS, _ROPE_WARPS = 4, 8


def rope_packed_qkv(qkv: torch.Tensor, table: torch.Tensor, num_prefix_tokens: int, interleaved: bool,
                    backward: bool = False) -> torch.Tensor:
    """timm's RoPE (``apply_rot_embed_cat``) on q and k of a packed QKV buffer, in one pass.

    Forward: a new packed buffer with q and k rotated and v copied, so that attention reads q, k and
    v as views of one buffer (TE's ``bs3hd``, no copies); backward (``backward=True``): the
    transposed rotation of q's and k's gradients, in place in the packed gradient, v's left as is.

    Args:
        qkv: ``[B, N, 3, H, D]`` (q, k, v of ``H`` heads of ``D`` channels, ``D`` even), CUDA,
            contiguous, bf16 or fp16.
        table: timm's ``[N - num_prefix_tokens, 2 * D]`` fp32 table (sin, then cos, per patch token
            and channel), contiguous, on ``qkv``'s device.
        num_prefix_tokens: leading tokens of each image left unrotated (class, register tokens).
        interleaved: channels pair as (2j, 2j + 1); else as (j, j + D/2) (timm's ``half``).
        backward: rotate back in place (the gradient), else forward into a new buffer.

    Returns:
        the new buffer (forward) or ``qkv`` itself (backward), ``[B, N, 3, H, D]``.
    """
    k = _kernels()
    B, N, _, H, D = qkv.shape
    out = qkv if backward else torch.empty_like(qkv)
    rows = B * N
    if rows:
        with torch.cuda.device(qkv.device):  # Triton launches on the current device
            k.rope_qk[(k.triton.cdiv(rows, _ROPE_ROWS),)](
                qkv, out, table, rows, N, num_prefix_tokens, 2 * H, H * D, D, D // 2, _ROPE_ROWS,
                k.triton.next_power_of_2(2 * H), k.triton.next_power_of_2(D // 2), k.triton.next_power_of_2(H * D),
                interleaved, backward,
                num_warps=_ROPE_WARPS)
    return out


# cast_transpose_dbias: 64 x 64 tiles, 4 warps, 4 programs an SM: the fastest correct launch of the
# 36 that docs/perf/ct_dbias_sweep.py times (results/levers/ct_dbias_sweep_lever49_h100.log)
_CT_BLOCK, _SUM_ROWS, _SUM_COLS = 64, 16, 64


def cast_transpose_dbias(grad: torch.Tensor, data: torch.Tensor, data_t: torch.Tensor, scale: torch.Tensor,
                         amax: torch.Tensor, scale_inv: torch.Tensor, e5m2: bool) -> torch.Tensor:
    """An output gradient's FP8 cast, the cast's transpose and the bias gradient, in one pass over
    the gradient (TE's ``bgrad_quantize`` for per-tensor delayed scaling).

    TE 2.20's fused kernel sums the bias gradient in two steps, the second a reduction over a few
    hundred partial rows by one thread per four columns (about 21 us a call on an H100, whatever the
    width); here the partial sums are reduced by a second kernel across the columns.

    Args:
        grad: ``[R, C]``, CUDA, contiguous, bf16 or fp16.
        data: ``[R, C]`` uint8, the FP8 cast's bytes (written).
        data_t: ``[C, R]`` uint8, its transpose (written).
        scale: the one-element fp32 scale the cast multiplies by.
        amax: the one-element fp32 amax to raise to ``max |grad|`` (atomically; not reset here).
        scale_inv: the one-element fp32 ``1 / scale`` (written).
        e5m2: cast to E5M2 (else E4M3).

    Returns:
        the bias gradient ``[C]`` in ``grad``'s dtype: column sums in fp32, rounded once.
    """
    k = _kernels()
    R, C = grad.shape
    dbias = torch.empty(C, device=grad.device, dtype=grad.dtype)
    if not R:
        return dbias.zero_()
    col_blocks = k.triton.cdiv(C, _CT_BLOCK)
    progs, per = _row_strips(R, grad.device, col_blocks, _CT_BLOCK)
    part = torch.empty(progs, C, device=grad.device, dtype=torch.float32)
    with torch.cuda.device(grad.device):  # Triton launches on the current device
        k.cast_transpose_dbias[(progs, col_blocks)](
            grad, data, data_t, part, scale, amax, scale_inv, R, C, per, 57344.0 if e5m2 else 448.0, e5m2,
            _CT_BLOCK, _CT_BLOCK, num_warps=4)
        k.column_sum[(k.triton.cdiv(C, _SUM_COLS),)](part, dbias, progs, C, _SUM_ROWS, _SUM_COLS)
    return dbias


# layernorm_backward_add: (rows a tile, warps, programs an SM), the fastest of the 8 launches
# docs/perf/ln_bwd_add_bench.py times at ViT-B/L/H widths (results/levers/ln_bwd_add_lever70_h100.log)
_LN_BWD_LAUNCH = (4, 8, 2)


def layernorm_backward_add(dz: torch.Tensor, x: torch.Tensor, mu: torch.Tensor, rsigma: torch.Tensor,
                           gamma: torch.Tensor, skip: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A LayerNorm's backward with another gradient of its input added: TE's ``layernorm_bwd``
    followed by ``dx + skip``, in one pass (4 passes over ``[R, C]`` where the two take 6).

    Args:
        dz: the norm output's gradient ``[R, C]``; x: its input ``[R, C]``; skip: the gradient to
            add ``[R, C]``; all CUDA, contiguous, one half-precision dtype.
        mu, rsigma: the forward's fp32 ``[R]`` row means and ``1 / std`` (TE's ``layernorm_fwd``'s).
        gamma: the norm weight ``[C]``, contiguous (any float dtype; used in fp32).

    Returns:
        ``dx + skip`` (``x``'s dtype: fp32 arithmetic, rounded once), and dgamma and dbeta ``[C]`` in
        ``gamma``'s dtype (fp32 column sums, rounded once), as TE returns them.
    """
    k = _kernels()
    R, C = x.shape
    dx = torch.empty_like(x)
    dgamma = torch.empty(C, device=x.device, dtype=gamma.dtype)  # column_sum writes every column
    dbeta = torch.empty_like(dgamma)
    if not R:
        return dx, dgamma.zero_(), dbeta.zero_()
    block_r, warps, per_sm = _LN_BWD_LAUNCH
    progs, per = _row_strips(R, x.device, 1, block_r, per_sm)
    part_w = torch.empty(progs, C, device=x.device, dtype=torch.float32)
    part_b = torch.empty(progs, C, device=x.device, dtype=torch.float32)
    with torch.cuda.device(x.device):  # Triton launches on the current device
        k.ln_bwd_add[(progs,)](dz, x, mu, rsigma, gamma, skip, dx, part_w, part_b, R, C, per, block_r,
                               k.triton.next_power_of_2(C), num_warps=warps)
        for part, out in ((part_w, dgamma), (part_b, dbeta)):
            k.column_sum[(k.triton.cdiv(C, _SUM_COLS),)](part, out, progs, C, _SUM_ROWS, _SUM_COLS)
    return dx, dgamma, dbeta
