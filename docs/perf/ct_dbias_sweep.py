"""Lever 49 (docs/performance.md), its microbenchmark: can a Triton pass cast an output gradient
to FP8, write its transpose and sum its columns (TE's ``bgrad_quantize`` / ``dbias_dgelu`` under
delayed scaling) as fast as TE's fused kernel, without TE's 21-23 us reduction? Tile shapes, warps
and programs an SM, per gradient of a ViT-B/16, ViT-L/16 and ViT-H/16 step.

    python3 docs/perf/ct_dbias_sweep.py        # on the GPU machine, TE installed

Why: lever 48's pass (commit ec7958d: 64 x 64 tiles, 4 warps, the column sums and amax reduced
across the tile every 64 rows) moved 0.6-1.5 TB/s where TE's kernel moves 2.1-2.4 (1.5 with its
reduction at width 768-1024; ``results/levers/bias_grad_lever48_h100.log``). Here the sums and the
amax stay per element in registers until the program's last row: the library's kernel
(``fp8vit._te.kernels.cast_transpose_dbias``) at each launch shape. The logged run (this script at
commit 3f73135, its own copy of the kernel) also stored the transpose as ``tl.trans`` of the tile
(no faster) and ran the GELU's backward first for fc1 (``dbias_dgelu``: 15-25% slower than TE's, so
fc1 stays TE's); both are gone with that copy. Beside them, the other split for the gradients
without a GELU: TE's cast-transpose (``tex.quantize``, no bias gradient) and torch's column sum,
which reads the gradient again. Each configuration's bytes are checked against TE's and its bias
gradient against TE's. Times: 20 back-to-back calls captured in a CUDA graph (as the training step
runs them: no host launch costs), CUDA events around each replay, median of 30, divided by 20.

Prediction (written before the first run): with the sums kept per element, the best configuration
moves >= 2.2 TB/s (TE's pass without its reduction: ~2.3); per step ViT-B -0.6 to -1.0 ms, ViT-L
-1.3 to -2.0 ms against TE's calls. If no configuration beats TE per step, lever 49 is dropped.
"""

import itertools

import fp8vit  # noqa: F401  imports TE (where installed) before torch runs a cuDNN kernel
import torch
import triton

from fp8vit._te import te_module, te_version
from fp8vit._te.kernels import _kernels
from microbench import STEP_ROWS as ROWS, VIT_WIDTHS as MODELS, per_call_ms

CONFIGS = ((32, 64, 4), (64, 64, 4), (64, 128, 4), (64, 128, 8), (128, 64, 8), (128, 128, 8))  # rows, cols, warps
PROGRAMS_PER_SM = (4, 8, 16)


def triton_call(cfg, per_sm, g, quantizer):
    """``[dbias, Float8 tensor]`` as TE's ``bgrad_quantize`` returns them, by the library's kernel at
    one launch shape (``fp8vit._te.kernels.cast_transpose_dbias`` fixes 64 x 64, 4 warps, 4 an SM)."""
    block_r, block_c, warps = cfg
    k = _kernels()
    R, C = g.shape
    out = quantizer.make_empty(g.shape, dtype=g.dtype, device=g.device)
    col_blocks = triton.cdiv(C, block_c)
    sms = torch.cuda.get_device_properties(g.device).multi_processor_count
    progs = max(1, min(triton.cdiv(R, block_r), per_sm * sms // col_blocks))
    per = triton.cdiv(triton.cdiv(R, progs), block_r) * block_r
    progs = triton.cdiv(R, per)
    part = torch.empty(progs, C, device=g.device, dtype=torch.float32)
    dbias = torch.empty(C, device=g.device, dtype=g.dtype)
    e5m2 = quantizer.dtype == te_module("transformer_engine_torch").DType.kFloat8E5M2
    k.cast_transpose_dbias[(progs, col_blocks)](g, out._data, out._transpose, part, quantizer.scale, quantizer.amax,
                                                out._scale_inv, R, C, per, 57344.0 if e5m2 else 448.0, e5m2,
                                                block_r, block_c, num_warps=warps)
    k.column_sum[(triton.cdiv(C, 64),)](part, dbias, progs, C, 16, 64)
    return [dbias, out]


def same(got, ref):
    """The cast and its transpose byte for byte as TE's, the bias gradient close."""
    return (torch.equal(got[1]._data, ref[1]._data) and torch.equal(got[1]._transpose, ref[1]._transpose)
            and torch.allclose(got[0].float(), ref[0].float(), rtol=2e-2, atol=1e-2 * float(ref[0].float().abs().mean())))


def main():
    tex = te_module("transformer_engine_torch")
    f8 = te_module("transformer_engine.pytorch.tensor.float8_tensor").Float8Quantizer

    def quantizer():
        return f8(scale=torch.tensor([64.0], device="cuda"), amax=torch.zeros(1, device="cuda"),
                  fp8_dtype=tex.DType.kFloat8E5M2)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, TE {te_version()}, triton {triton.__version__}")
    for model, (C, depth) in MODELS.items():
        te_total = best_total = 0.0
        for name, cols, times in (("qkv", 3 * C, 1), ("proj, fc2", C, 2)):
            g = torch.randn(ROWS, cols, device="cuda", dtype=torch.bfloat16) * 1e-3
            moved = ROWS * cols * 4  # bf16 in, two FP8 out

            def te_fn(q=quantizer()):
                return tex.bgrad_quantize(g, q)
            ref, te_ms = te_fn(), per_call_ms(te_fn)
            q_split = quantizer()  # the other split: TE's cast-transpose alone, the sum by torch (a second read)
            split_ms = per_call_ms(lambda: (g.sum(0), tex.quantize(g, q_split)))
            print(f"{model} {name}: TE's cast-transpose without the bias gradient + torch's column sum "
                  f"{split_ms * 1e3:.1f} us")
            rows = []
            for cfg, per_sm in itertools.product(CONFIGS, PROGRAMS_PER_SM):
                q = quantizer()
                try:
                    ok = same(triton_call(cfg, per_sm, g, q), ref)
                    ms = per_call_ms(lambda: triton_call(cfg, per_sm, g, q))
                except Exception as err:  # a shape Triton cannot compile (registers, shared memory)
                    print(f"  {model} {name} {cfg} x{per_sm}: {type(err).__name__}: {str(err)[:100]}")
                    continue
                rows.append((ms, cfg, per_sm, ok))
            rows.sort()
            print(f"{model} {name} ({ROWS} x {cols}): TE {te_ms * 1e3:.1f} us ({moved / te_ms / 1e6:.0f} GB/s); "
                  f"fastest 5 (rows, cols, warps; programs an SM; the library's: (64, 64, 4) x4):")
            for ms, cfg, per_sm, ok in rows[:5]:
                print(f"    {ms * 1e3:7.1f} us {moved / ms / 1e6:6.0f} GB/s  {cfg} x{per_sm}  {'same as TE' if ok else 'DIFFERS'}")
            best = next((ms for ms, _, _, ok in rows if ok), te_ms)
            te_total += te_ms * depth * times
            best_total += best * depth * times
        print(f"{model} per step (qkv, proj, fc2): TE {te_total:.2f} ms, fastest correct Triton {best_total:.2f} ms, "
              f"difference {best_total - te_total:+.2f} ms")


if __name__ == "__main__":
    main()
