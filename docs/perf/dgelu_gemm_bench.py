"""Lever 59 (docs/performance.md), its microbenchmark: fc1's GELU backward in the epilogue of fc2's
FP8 dgrad GEMM, the GEMM writing the FP8 gradient itself.

    python3 docs/perf/dgelu_gemm_bench.py      # on the GPU machine, TE installed

Why: in a graphed ViT step TE 2.20's ``LayerNormMLP`` backward runs fc2's dgrad GEMM with a bf16
output ``[T, H]`` (``T`` tokens, ``H`` hidden units), then ``tex.dbias_dgelu`` (its
``CTDBiasDAct`` kernel) reads that and the saved pre-GELU ``fc1_out`` ``[T, H]`` bf16 and writes
the FP8 gradient, its transpose and fc1's bias gradient: 2 + 2 + 2 + 1 + 1 = 8 bytes an element
(ViT-L/16 b128 on an H100: 5.74 ms a step, 239 us a call, about 2.6 TB/s;
``results/profile/vit_large*_sync_h100.kernels.txt``). cuBLASLt can apply the GELU's derivative
in the GEMM's epilogue (``CUBLASLT_EPILOGUE_DGELU``, the pre-GELU read as its aux input) and
write D in FP8 with its amax: TE's ``general_gemm(..., grad=True, gelu=True, gelu_in=...)`` with an
FP8 quantizer asks for exactly that, though TE uses it only without FP8. What is left is the
transpose (fc1's wgrad GEMM takes the gradient column-wise) and the bias gradient: one Triton pass
over the FP8 bytes (1 + 1 bytes an element) that sums the dequantized values
(``fp8vit._te.kernels.fp8_transpose_dbias``). Last, a whole ``te.LayerNormMLP`` forward and backward
with and without the library's patch (``fp8vit._te.dgelu_gemm``): every gradient's SNR against TE's. Bytes an element:
2 (aux) + 1 (D) + 2 against 2 (D) + 8: 5 against 10.

The bias gradient then sums the FP8 values (E5M2 under the HYBRID recipe), as fc1's weight
gradient does (its wgrad GEMM reads the same bytes), where TE sums the bf16 gradient. Both are
compared with an fp32 reference (the dgrad product of the same FP8 inputs, tanh GELU's
derivative) by signal-to-noise ratio, the gradient too; cuBLASLt's bytes against TE's.

Times: 20 back-to-back calls captured in a CUDA graph, median of 30 replays, divided by 20
(``microbench.per_call_ms``). TE's bias gradient for the GEMM epilogue (``DGELU_BGRAD``) is not
usable here: TE 2.20 sizes the bias gradient by B's last dimension (``C``), cuBLASLt writes ``H``.

Prediction (written before the first run): cuBLASLt takes FP8 inputs with DGELU and an FP8 D;
the epilogue costs the dgrad GEMM 30-60 us at ViT-L (its aux read, 206 MB), the transpose and sum
70-80 us, against TE's 239 us: per step ViT-B -0.8 to -1.2 ms, ViT-L -2.4 to -3.4, ViT-H -3 to
-4.5. The dbias SNR within 3 dB of the weight gradient's class (FP8 E5M2: ~25-30 dB); TE's
bf16 dbias higher. Below -1 ms at ViT-L, or cuBLASLt refusing, the lever is dropped.
"""

import math

import fp8vit  # noqa: F401  imports TE (where installed) before torch runs a cuDNN kernel
import torch
import triton

from fp8vit._te import te_module, te_version
from fp8vit._te.dgelu_gemm import set_dgelu_gemm
from fp8vit._te.kernels import cast_transpose_dbias, fp8_transpose_dbias
from fp8vit.training.numerics import snr_db as _snr
from microbench import per_call_ms

ROWS = 128 * 197
MODELS = {"ViT-B/16": (768, 12), "ViT-L/16": (1024, 24), "ViT-H/16": (1280, 32)}  # width, depth
E5M2_MAX = 57344.0


def transpose_dbias(data, data_t, scale_inv):
    """``data`` [R, C] E5M2 bytes: their transpose into ``data_t``, and the bias gradient [C] bf16."""
    return fp8_transpose_dbias(data, data_t, scale_inv, True, torch.bfloat16)


def snr_db(got, ref):
    return _snr(ref.float(), got.float())


def dgelu_tanh(z):
    k = math.sqrt(2 / math.pi)
    t = torch.tanh(k * (z + 0.044715 * z ** 3))
    return 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * k * (1 + 3 * 0.044715 * z * z)


def main():
    tex = te_module("transformer_engine_torch")
    f8 = te_module("transformer_engine.pytorch.tensor.float8_tensor").Float8Quantizer
    gemm = te_module("transformer_engine.pytorch.cpp_extensions").general_gemm
    E4M3, E5M2 = tex.DType.kFloat8E4M3, tex.DType.kFloat8E5M2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, TE {te_version()}, triton {triton.__version__}")
    print("per call (us) and per step (ms): TE = fc2 dgrad GEMM (bf16 out) + tex.dbias_dgelu; "
          "fused = the GEMM with DGELU and FP8 out + Triton transpose and bias sum")
    torch.manual_seed(0)
    for model, (C, depth) in MODELS.items():
        H = 4 * C

        def quantizer(dtype, amax_of, columnwise=True):
            scale = torch.tensor([(448.0 if dtype == E4M3 else E5M2_MAX) / float(amax_of) / 2], device="cuda")
            return f8(scale=scale, amax=torch.zeros(1, device="cuda"), fp8_dtype=dtype, columnwise=columnwise)

        w_hp = torch.randn(C, H, device="cuda", dtype=torch.bfloat16) * 0.02         # fc2.weight [out C, in H]
        dy_hp = torch.randn(ROWS, C, device="cuda", dtype=torch.bfloat16) * 1e-3      # fc2's output gradient
        fc1_out = torch.randn(ROWS, H, device="cuda", dtype=torch.bfloat16)           # pre-GELU, with bias
        w = quantizer(E4M3, w_hp.abs().max())(w_hp)
        dy = quantizer(E5M2, dy_hp.abs().max())(dy_hp)
        # fp32 reference from the same FP8 inputs: the numerics compared are the epilogue's alone
        w_dq, dy_dq = w.dequantize().float(), dy.dequantize().float()
        ref = (dy_dq @ w_dq) * dgelu_tanh(fc1_out.float())                           # [T, H]
        ref_dbias = ref.sum(0)
        q_te = quantizer(E5M2, ref.abs().max())
        q_fused = quantizer(E5M2, ref.abs().max(), columnwise=False)
        q_fused.scale.copy_(q_te.scale)
        data_t = torch.empty(H, ROWS, device="cuda", dtype=torch.uint8)

        def te_path():
            out, *_ = gemm(w, dy, out_dtype=torch.bfloat16, layout="NN", grad=True, use_split_accumulator=True)
            return tex.dbias_dgelu(out, fc1_out, q_te)

        def fused_gemm():
            out, *_ = gemm(w, dy, out_dtype=torch.bfloat16, quantization_params=q_fused, layout="NN", grad=True,
                           gelu=True, gelu_in=fc1_out, use_split_accumulator=True)
            return out

        def fused_path():
            out = fused_gemm()
            return transpose_dbias(out._data, data_t, out._scale_inv), out

        def plain_gemm():
            return gemm(w, dy, out_dtype=torch.bfloat16, layout="NN", grad=True, use_split_accumulator=True)[0]

        def bf16_dgelu_then_lever49():  # the epilogue in bf16, then fp8vit's cast + transpose + dbias
            out, *_ = gemm(w, dy, out_dtype=torch.bfloat16, layout="NN", grad=True, gelu=True, gelu_in=fc1_out,
                           use_split_accumulator=True)
            d = q_te.make_empty(out.shape, dtype=out.dtype, device=out.device)
            return cast_transpose_dbias(out, d._data, d._transpose, q_te.scale, q_te.amax, d._scale_inv, True), d

        te_dbias, te_dact = te_path()
        te_amax = float(q_te.amax)
        try:
            f_dbias, f_dact = fused_path()
        except Exception as err:  # cuBLASLt (or TE) refusing the epilogue with FP8: the lever's answer
            print(f"{model}: fused GEMM refused: {type(err).__name__}: {str(err)[:300]}")
            continue
        torch.cuda.synchronize()
        same = float((f_dact._data == te_dact._data).float().mean())
        same_t = float((data_t == te_dact._transpose).float().mean())
        print(f"{model} C={C} H={H} T={ROWS}: FP8 bytes equal to TE's {same:.4f} (transpose {same_t:.4f}); "
              f"amax TE {te_amax:.4g} fused {float(q_fused.amax):.4g}; scale_inv equal "
              f"{bool(torch.equal(f_dact._scale_inv, te_dact._scale_inv))}")
        print(f"  SNR vs fp32 ref (dB): gradient TE {snr_db(te_dact.dequantize().float(), ref):.2f} "
              f"fused {snr_db(f_dact.dequantize().float(), ref):.2f}; bias gradient TE "
              f"{snr_db(te_dbias.float(), ref_dbias):.2f} fused {snr_db(f_dbias.float(), ref_dbias):.2f}")
        try:
            b_dbias, b_dact = bf16_dgelu_then_lever49()
            print(f"  bf16 DGELU + lever 49: gradient SNR {snr_db(b_dact.dequantize().float(), ref):.2f}, "
                  f"bias {snr_db(b_dbias.float(), ref_dbias):.2f}")
            t_b = per_call_ms(bf16_dgelu_then_lever49) * 1e3
        except Exception as err:
            print(f"  bf16 DGELU refused: {type(err).__name__}: {str(err)[:200]}")
            t_b = float("nan")
        t_te = per_call_ms(te_path) * 1e3
        t_plain = per_call_ms(plain_gemm) * 1e3
        t_fg = per_call_ms(fused_gemm) * 1e3
        t_tr = per_call_ms(lambda: transpose_dbias(f_dact._data, data_t, f_dact._scale_inv)) * 1e3
        t_f = per_call_ms(fused_path) * 1e3
        gbs = 2 * ROWS * H / (t_tr * 1e-6) / 1e12
        print(f"  us/call: TE {t_te:.1f} (GEMM {t_plain:.1f} + dbias_dgelu {t_te - t_plain:.1f}); fused {t_f:.1f} "
              f"(GEMM+DGELU {t_fg:.1f}, transpose+dbias {t_tr:.1f} = {gbs:.2f} TB/s); bf16 DGELU + lever 49 {t_b:.1f}")
        print(f"  per step ({depth} blocks): fused {(t_f - t_te) * depth / 1e3:+.3f} ms, "
              f"bf16 DGELU + lever 49 {(t_b - t_te) * depth / 1e3:+.3f} ms against TE's")

    module_check()


def module_check():
    """One te.LayerNormMLP (ViT-L widths) under FP8 delayed scaling, forward and backward as TE runs
    it and with fp8vit's patch: each gradient's SNR (dB) against TE's, the output's equality."""
    te = te_module("transformer_engine.pytorch")
    recipe = te_module("transformer_engine.common.recipe").DelayedScaling()
    torch.manual_seed(0)
    mlp = te.LayerNormMLP(1024, 4096, bias=True, activation="gelu", params_dtype=torch.float32).cuda()
    mlp.gemm_gelu_fusion = True  # as fp8vit's blocks run it (lever 12)
    x = torch.randn(128 * 197, 1024, device="cuda", requires_grad=True)
    dy = torch.randn(128 * 197, 1024, device="cuda", dtype=torch.bfloat16)
    results = []
    for fused in (False, True, False, True):  # twice each: the second with the first's amax history
        mlp.zero_grad(set_to_none=True)
        x.grad = None
        on = set_dgelu_gemm(fused)
        with torch.autocast("cuda", torch.bfloat16), te.fp8_autocast(True, recipe):
            y = mlp(x)
            y.backward(dy)
        set_dgelu_gemm(False)
        results.append((on, y.detach().float(), {n: p.grad.float().clone() for n, p in mlp.named_parameters()},
                        x.grad.float().clone()))
    (_, y_te, g_te, dx_te), (on, y_f, g_f, dx_f) = results[2], results[3]
    print(f"LayerNormMLP 1024->4096 T={128 * 197}, patch installed: {on}; output equal: {torch.equal(y_te, y_f)}")
    print("  SNR against TE's (dB): input " + f"{snr_db(dx_f, dx_te):.1f}, "
          + ", ".join(f"{n} {snr_db(g_f[n], g_te[n]):.1f}" for n in g_te))


if __name__ == "__main__":
    main()
