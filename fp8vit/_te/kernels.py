"""Triton kernels for the elementwise work of a training step that torch runs as several passes.

LayerScale's backward (:func:`layerscale_backward`, for :class:`fp8vit.blocks.base.LayerScaleAdd`) and
drop path's per-sample scale with the residual add (:func:`row_scale_add`, for
:class:`fp8vit.blocks.base.DropPathAdd`).
Triton comes with torch's CUDA wheels; it is imported on first use on a CUDA tensor only, so that
``import fp8vit`` stays light and CPU-only installs never touch it. Where it cannot run, the callers
keep their torch expression (:func:`triton_support` says why). ``FP8VIT_TRITON=0`` turns the
kernels off (for a cluster whose Triton cannot compile: it needs a C compiler and a writable cache).
"""

from __future__ import annotations

import functools
import os
from typing import Optional, Tuple

import torch

from ..errors import Check

__all__ = ["triton_support", "layerscale_backward", "row_scale_add"]


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
    except Exception as e:
        return Check(False, f"Triton is installed but its first kernel failed with {type(e).__name__}: {e}; "
                            "fix the Triton setup (a C compiler, a writable ~/.triton cache) or set FP8VIT_TRITON=0")
    return Check(True)


@functools.lru_cache(maxsize=None)
def _kernels():
    import triton
    import triton.language as tl

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
    def row_scale_add_kernel(X, Y, M, OUT, N, PER, HAS_X: tl.constexpr, BLOCK: tl.constexpr):
        # OUT = X + Y * M[row] (or Y * M[row] without X) over N elements of contiguous [S, ...]
        # tensors, row = element // PER: one fp32 multiply-add per element, rounded once, as
        # torch's addcmul and mul compute it. Contiguous loads and stores (torch's broadcast of a
        # [S, 1, ..., 1] operand runs its non-vectorized kernel).
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < N
        scale = tl.load(M + offs // PER, mask=m, other=0.0).to(tl.float32)
        r = tl.load(Y + offs, mask=m, other=0.0).to(tl.float32) * scale
        if HAS_X:
            r += tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(OUT + offs, r.to(OUT.dtype.element_ty), mask=m)

    return triton, layerscale_bwd, row_scale_add_kernel


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
    triton, kernel, _ = _kernels()
    C = grad.shape[-1]
    g2, y2 = grad.reshape(-1, C).contiguous(), y.reshape(-1, C).contiguous()
    R = g2.shape[0]
    col_blocks = triton.cdiv(C, _BLOCK_C)
    # About four programs per SM, each summing a strip of rows: enough to fill the GPU, few enough
    # that the partial sums [programs, C] are small.
    sms = torch.cuda.get_device_properties(grad.device).multi_processor_count
    row_progs = max(1, min(triton.cdiv(R, _BLOCK_R), 4 * sms // col_blocks))
    rows_per_prog = triton.cdiv(triton.cdiv(R, row_progs), _BLOCK_R) * _BLOCK_R
    row_progs = triton.cdiv(R, rows_per_prog)
    dy = torch.empty_like(g2)
    part = torch.empty(row_progs, C, device=grad.device, dtype=torch.float32)
    with torch.cuda.device(grad.device):  # Triton launches on the current device
        kernel[(row_progs, col_blocks)](g2, y2, gamma.contiguous(), dy, part, R, C, rows_per_prog, _BLOCK_R, _BLOCK_C)
    return dy.view(grad.shape), part.sum(0)


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
    triton, _, kernel = _kernels()
    n = y.numel()
    out = torch.empty_like(y)
    if n:
        per = n // y.shape[0]
        with torch.cuda.device(y.device):  # Triton launches on the current device
            kernel[(triton.cdiv(n, _BLOCK_ROW_SCALE),)](y if x is None else x, y, scale, out, n, per, x is not None,
                                                       _BLOCK_ROW_SCALE)
    return out
