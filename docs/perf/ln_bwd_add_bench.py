"""Lever 70 (docs/performance.md), its microbenchmark: the LayerNorm backward with the residual
stream's gradient added in the same pass, against TE's ``layernorm_bwd`` and torch's add.

    python3 docs/perf/ln_bwd_add_bench.py      # GPU machine, TE installed

Why: a ViT block is ``x1 = x + attn(norm1(x))``, ``x2 = x1 + mlp(norm2(x1))``. In the backward,
the gradient of ``x`` is the skip path's (the block output's gradient ``g``) plus the norm's input
gradient, which TE's ``LayerNormLinear`` / ``LayerNormMLP`` return from ``layernorm_bwd``; autograd
then sums the two in a separate kernel. At ViT-L/16 b128 on an H100 that add is 49 us a call and
the norm's backward 55 (``results/profile/vit_large*_sync_h100.kernels.txt``), 48 calls a step.
Read ``g`` in the norm's backward and write ``dx + g`` once: 4 passes over ``[T, C]`` bf16 instead
of 3 + 3.

Lever 51 fused the same add but its Triton backward worked one row at a time per program (77.5 us
against TE's 49.8 at ViT-L on an H200: too few loads in flight). The library's kernel
(``fp8vit._te.kernels``' ``ln_bwd_add``) holds a tile of ``BLOCK_R`` whole rows, each program
walking a strip of rows and keeping its column sums of ``dz * xhat`` and ``dz`` (dgamma, dbeta) in
registers, written once; the ``[programs, C]`` partials are summed by a second small kernel.

Timed per call in a CUDA graph (``microbench.per_call_ms``): TE's backward (its own kernels and
cuDNN's, ``fp8vit.set_cudnn_layernorm``: the graphs' choice where TE has no tuned kernel) followed by
the add, against the fused pass at several launch shapes. Checked against TE's: dx + g, dgamma,
dbeta (relative to their largest values).

Prediction (written before the first run): TE 104 us a call at ViT-L (55 + 49), the fused pass
75-85 us (4 x 51.6 MB at 2.4-2.75 TB/s): -0.9 to -1.4 ms a ViT-L step (48 calls), ViT-B -0.3 to
-0.5 (24), ViT-H -0.8 to -1.5 against cuDNN's (64). Under -0.6 ms at ViT-L the lever stops here.
"""

import fp8vit  # first: imports TE (where installed) before torch runs a cuDNN kernel
import torch
import triton

from fp8vit._te import kernels, te_module, te_version
from microbench import STEP_ROWS as ROWS, VIT_WIDTHS, per_call_ms, residual_stream

# (BLOCK_R rows a tile, warps, programs an SM); the library's launch was (4, 4, 4) at the first run
CONFIGS = [(4, 4, 4), (4, 8, 2), (8, 8, 2), (8, 4, 4), (2, 4, 8), (16, 8, 1), (4, 4, 8), (2, 4, 4)]


def fused_ln_bwd_add(dz, x, mu, rs, w, g, cfg):
    """The library's kernel (``fp8vit._te.kernels.layernorm_backward_add``) at another launch shape:
    ``(dx + g, dgamma, dbeta)``, dgamma and dbeta in ``w``'s dtype, as TE returns them."""
    k = kernels._kernels()
    block_r, warps, per_sm = cfg
    R, C = x.shape
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    progs = min(triton.cdiv(R, block_r), per_sm * sms)
    per = triton.cdiv(triton.cdiv(R, progs), block_r) * block_r
    progs = triton.cdiv(R, per)
    dx = torch.empty_like(x)
    part_w = torch.empty(progs, C, device=x.device)
    part_b = torch.empty(progs, C, device=x.device)
    k.ln_bwd_add[(progs,)](dz, x, mu, rs, w, g, dx, part_w, part_b, R, C, per, block_r, triton.next_power_of_2(C),
                           num_warps=warps)
    dw = torch.empty(C, device=x.device, dtype=w.dtype)
    db = torch.empty(C, device=x.device, dtype=w.dtype)
    k.column_sum[(triton.cdiv(C, 64),)](part_w, dw, progs, C, 16, 64)
    k.column_sum[(triton.cdiv(C, 64),)](part_b, db, progs, C, 16, 64)
    return dx, dw, db


def rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def main():
    tex = te_module("transformer_engine_torch")
    kernels.triton_support()  # compiles fp8vit's kernels' launcher
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, TE {te_version()}, Triton {triton.__version__}")
    eps = 1e-6
    for name, (C, depth) in VIT_WIDTHS.items():
        torch.manual_seed(0)
        x, w, b = residual_stream(C)
        _, mu, rs = tex.layernorm_fwd(x, w, b, eps, None, None, tex.DType.kBFloat16, 0, False)
        dz = (torch.randn(ROWS, C, device="cuda") * 1e-3).to(torch.bfloat16)
        g = (torch.randn(ROWS, C, device="cuda") * 1e-3).to(torch.bfloat16)

        def te_bwd_add():
            dx, dw, db = tex.layernorm_bwd(dz, x, mu, rs, w, 0, False)
            return dx + g, dw, db

        times = {}
        for backend, on in (("TE", False), ("TE cuDNN", True)):
            fp8vit.set_cudnn_layernorm(on)  # TE's switch, process-wide
            try:
                times[backend] = per_call_ms(te_bwd_add) * 1e3
                times[backend + " bwd alone"] = per_call_ms(lambda: tex.layernorm_bwd(dz, x, mu, rs, w, 0, False)) * 1e3
            except Exception as err:  # cuDNN's LayerNorm can refuse: say so, go on
                print(f"{name}: {backend} failed: {type(err).__name__}: {str(err)[:150]}")
        fp8vit.set_cudnn_layernorm(False)
        ref_dx, ref_dw, ref_db = te_bwd_add()
        best_te = min(v for k, v in times.items() if "alone" not in k)
        print(f"{name} R={ROWS} C={C}: " + ", ".join(f"{k} {v:.1f} us" for k, v in times.items()))
        for cfg in CONFIGS:
            try:
                t = per_call_ms(lambda: fused_ln_bwd_add(dz, x, mu, rs, w, g, cfg)) * 1e3
            except Exception as err:  # a launch shape this Triton cannot compile or fit
                print(f"  fused {cfg}: failed: {type(err).__name__}: {str(err)[:150]}")
                continue
            dx, dw, db = fused_ln_bwd_add(dz, x, mu, rs, w, g, cfg)
            print(f"  fused (rows, warps, programs/SM) {cfg}: {t:.1f} us ({t - best_te:+.1f} vs TE's best + add, "
                  f"{(t - best_te) * 2 * depth / 1e3:+.2f} ms a step, {2 * depth} calls); rel err vs TE: dx+g "
                  f"{rel(dx, ref_dx):.1e}, dgamma {rel(dw, ref_dw):.1e}, dbeta {rel(db, ref_db):.1e}")


if __name__ == "__main__":
    main()
