"""Lever 48 (docs/performance.md): an output gradient's FP8 cast, its transpose and the bias gradient
by TE's fused calls (``bgrad_quantize``; ``dbias_dgelu`` for fc1) against fp8vit's kernel
(``fp8vit._te.set_bias_grad_kernel``), per call at the shapes of a ViT-B/16 and a ViT-L/16 step.

    python3 docs/perf/bias_grad_bench.py        # on the GPU machine, TE installed

Rows: each Linear's output gradient at batch 128 (197 tokens an image, 25216 rows): qkv (3C
columns), proj and fc2 (C), and fc1 with the GELU's backward (4C), as TE's per-tensor delayed
scaling casts them (E5M2, the gradient format of the HYBRID recipe). Per step: the call's time
times the depth. GB/s: the bytes each call must move (read the gradient, and the GELU's input for
fc1; write the cast and its transpose) over its time.
Times: CUDA events around 20 back-to-back calls, median of 30 after 5 warm-up, divided by 20.

Prediction (written before the first run): TE's calls are its cast-transpose kernel at ~80% of the
H100's bandwidth plus a 21-23 us reduction (docs/results/profile/*_sync_h100.kernels.txt: 96 calls,
2.17 ms a ViT-L step); fp8vit's within +-10% of TE's pass plus ~3 us for its column reduce: per
step ViT-B -0.5 to -1.0 ms, ViT-L -1.2 to -2.2 ms.
"""

import fp8vit  # noqa: F401  imports TE (where installed) before torch runs a cuDNN kernel
import torch

from fp8vit._te import set_bias_grad_kernel, te_module

ROWS = 128 * 197
MODELS = {"ViT-B/16": (768, 12), "ViT-L/16": (1024, 24)}  # width, depth


def per_call_ms(fn, calls=20, reps=30, warmup=5):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def main():
    tex = te_module("transformer_engine_torch")
    f8 = te_module("transformer_engine.pytorch.tensor.float8_tensor").Float8Quantizer
    quantizer = f8(scale=torch.tensor([64.0], device="cuda"), amax=torch.zeros(1, device="cuda"),
                   fp8_dtype=tex.DType.kFloat8E5M2)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, TE {fp8vit._te.te_version()}")
    print(f"{'model':9s} {'gradient':16s} {'TE us':>8s} {'fp8vit us':>10s} {'TE GB/s':>8s} {'fp8vit GB/s':>11s}")
    for model, (C, depth) in MODELS.items():
        totals = {False: 0.0, True: 0.0}
        for name, cols, gelu in (("qkv", 3 * C, False), ("proj, fc2 (x2)", C, False), ("fc1 + dgelu", 4 * C, True)):
            g = torch.randn(ROWS, cols, device="cuda", dtype=torch.bfloat16) * 1e-3
            act = torch.randn_like(g) if gelu else None
            moved = ROWS * cols * (2 + (2 if gelu else 0) + 2)  # bf16 in (x2 with dgelu), two FP8 out
            ms = {}
            for ours in (False, True):
                set_bias_grad_kernel(ours)  # TE looks the function up at each call, as modules do
                if gelu:
                    ms[ours] = per_call_ms(lambda: tex.dbias_dgelu(g, act, quantizer))
                else:
                    ms[ours] = per_call_ms(lambda: tex.bgrad_quantize(g, quantizer))
                totals[ours] += ms[ours] * depth * (2 if name.startswith("proj") else 1)
            set_bias_grad_kernel(False)
            print(f"{model:9s} {name:16s} {ms[False] * 1e3:8.1f} {ms[True] * 1e3:10.1f} "
                  f"{moved / ms[False] / 1e6:8.0f} {moved / ms[True] / 1e6:11.0f}")
        print(f"{model} per step: TE {totals[False]:.2f} ms, fp8vit {totals[True]:.2f} ms, "
              f"difference {totals[True] - totals[False]:+.2f} ms")


if __name__ == "__main__":
    main()
