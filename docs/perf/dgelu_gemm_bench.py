"""Lever 59 (docs/performance.md), its microbenchmark: fc1's GELU backward in the epilogue of fc2's
FP8 dgrad GEMM, the GEMM writing the FP8 gradient itself. Dropped: cuBLASLt has no such kernel.

    python3 docs/perf/dgelu_gemm_bench.py      # on the GPU machine, TE installed

Why: in a graphed ViT step TE 2.20's ``LayerNormMLP`` backward runs fc2's dgrad GEMM with a bf16
output ``[T, H]`` (``T`` tokens, ``H`` hidden units), then ``tex.dbias_dgelu`` (its
``CTDBiasDAct`` kernel) reads that and the saved pre-GELU ``fc1_out`` ``[T, H]`` bf16 and writes
the FP8 gradient, its transpose and fc1's bias gradient: 2 + 2 + 2 + 1 + 1 = 8 bytes an element
(ViT-L/16 b128 on an H100: 5.74 ms a step, 239 us a call, about 2.6 TB/s;
``results/profile/vit_large*_sync_h100.kernels.txt``). cuBLASLt's ``DGELU`` epilogue applies the
GELU's derivative in the GEMM (``fc1_out`` its aux input); with an FP8 D and its amax, TE's
``general_gemm(..., grad=True, gelu=True, gelu_in=...)`` asks for exactly that (TE uses it only
without FP8). Left would be the transpose and the bias gradient from the FP8 bytes, one Triton pass:
2 + 1 + 2 bytes an element against 10.

Prediction (written before the first run): cuBLASLt takes FP8 inputs with DGELU and an FP8 D; the
epilogue costs the dgrad GEMM 30-60 us at ViT-L, the transpose and sum 70-80 us, against TE's 239
us: per step ViT-B -0.8 to -1.2 ms, ViT-L -2.4 to -3.4, ViT-H -3 to -4.5. Below -1 ms at ViT-L, or
cuBLASLt refusing, the lever is dropped.

Measured (``results/levers/dgelu_gemm_lever59_h100.log``, H100, TE 2.20.2, torch 2.11+cu130):
cuBLASLt refuses the fused GEMM at ViT-B/L/H shapes ("Unable to find suitable cuBLAS GEMM
algorithm"), so the lever was dropped. That log is of this script at commit e422164, which also held
the library's patch (a deferred fc2 dgrad and the Triton pass) and a whole-``LayerNormMLP`` check
in which the patch fell back to TE's kernels; both went with the lever. This script keeps the
question and TE's cost: it prints the refusal, or, where a later cuBLASLt has the kernel, the
fused GEMM's time and its FP8 bytes against TE's.
"""

import fp8vit  # noqa: F401  imports TE (where installed) before torch runs a cuDNN kernel
import torch

from fp8vit._te import te_module, te_version
from microbench import STEP_ROWS as ROWS, VIT_WIDTHS as MODELS, per_call_ms



def main():
    tex = te_module("transformer_engine_torch")
    f8 = te_module("transformer_engine.pytorch.tensor.float8_tensor").Float8Quantizer
    gemm = te_module("transformer_engine.pytorch.cpp_extensions").general_gemm
    E4M3, E5M2 = tex.DType.kFloat8E4M3, tex.DType.kFloat8E5M2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, TE {te_version()}")
    torch.manual_seed(0)
    for model, (C, depth) in MODELS.items():
        H = 4 * C

        def quantizer(dtype, amax_of, columnwise=True):
            scale = torch.tensor([(448.0 if dtype == E4M3 else 57344.0) / float(amax_of) / 2], device="cuda")
            return f8(scale=scale, amax=torch.zeros(1, device="cuda"), fp8_dtype=dtype, columnwise=columnwise)

        w_hp = torch.randn(C, H, device="cuda", dtype=torch.bfloat16) * 0.02         # fc2.weight [out C, in H]
        dy_hp = torch.randn(ROWS, C, device="cuda", dtype=torch.bfloat16) * 1e-3      # fc2's output gradient
        fc1_out = torch.randn(ROWS, H, device="cuda", dtype=torch.bfloat16)           # pre-GELU, with bias
        w, dy = quantizer(E4M3, w_hp.abs().max())(w_hp), quantizer(E5M2, dy_hp.abs().max())(dy_hp)
        q_te = quantizer(E5M2, 1e-3)
        q_fused = quantizer(E5M2, 1e-3, columnwise=False)

        def te_path():  # what TE 2.20's LayerNormMLP backward runs
            out, *_ = gemm(w, dy, out_dtype=torch.bfloat16, layout="NN", grad=True, use_split_accumulator=True)
            return tex.dbias_dgelu(out, fc1_out, q_te)

        def fused_gemm():
            return gemm(w, dy, out_dtype=torch.bfloat16, quantization_params=q_fused, layout="NN", grad=True,
                        gelu=True, gelu_in=fc1_out, use_split_accumulator=True)[0]

        t_te = per_call_ms(te_path) * 1e3
        line = f"{model} C={C} H={H} T={ROWS}: TE's GEMM + dbias_dgelu {t_te:.1f} us a call ({t_te * depth / 1e3:.2f} ms a step)"
        try:
            fused = fused_gemm()
        except RuntimeError as err:  # cuBLASLt without the kernel: the lever's answer
            print(f"{line}; fused GEMM refused: {str(err).strip()[:200]}")
            continue
        same = float((fused._data == te_path()[1]._data).float().mean())
        print(f"{line}; fused GEMM {per_call_ms(fused_gemm) * 1e3:.1f} us, its FP8 bytes equal to TE's {same:.4f}")


if __name__ == "__main__":
    main()
