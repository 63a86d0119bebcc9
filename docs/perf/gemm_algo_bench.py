"""Lever 60 (docs/performance.md), its microbenchmark: does cuBLASLt have faster algorithms for a
ViT step's FP8 GEMMs than the one its heuristic puts first, which is the one TE 2.20 always runs?

    python3 docs/perf/gemm_algo_bench.py [--models ViT-L/16 ...] [--algos 16]   # GPU machine

Why: TE's ``cublas_gemm`` asks ``cublasLtMatmulAlgoGetHeuristic`` for one result and runs it. In a
graphed ViT-L/16 b128 step on an H100 the GEMMs are 38.5 of 81.7 ms of kernel time
(``results/profile/vit_large*_sync_h100.kernels.txt``), and one stands out: fc1's forward, with
the GELU, bias and pre-GELU (aux) output in its epilogue, takes 271 us a call where fc2's forward,
the same FLOPs, takes 145 us. The kernel is cooperative, so its epilogue's 309 MB of writes (FP8
GELU output and bf16 aux, [T, 4C]) run after the main loop instead of beside it; a ping-pong or
another tile would overlap them. The dgrad GEMMs run at ~1240 TFLOP/s, the wgrad ones at ~1370.

This script builds each of a block's twelve FP8 GEMMs as TE does (the same cuBLASLt descriptors:
types, transposes, fast accumulation, scales, bias and aux epilogues, FP8 output with its amax,
fp32 wgrad written into ``main_grad``), asks the heuristic for up to ``--algos`` algorithms
and times each (ten calls captured in a CUDA graph, median of 20 replays, per call). It checks the first against TE's
own call of the same GEMM (the times should match), checks every algorithm's output against the
first's, and prints the step time the best correct algorithm of each GEMM would save.

Prediction (written before the first run): the best of 16 beats the first by 10-25% on fc1's
forward and by 0-5% on the other GEMMs; per step, ViT-B -0.4 to -1.2 ms, ViT-L -1 to -3, ViT-H
-1.5 to -4. Under -1 ms at ViT-L the lever stops here; above, the library would run the chosen
algorithm itself in the graphed step (its own cuBLASLt call where TE's heuristic loses).

Lever 61, in the same run: the residual add after proj and after fc2 (``x + attn(...)``,
``x + mlp(...)``: 48 kernels, 2.5 ms of a ViT-L step, each reading two [T, C] bf16 tensors and
writing one) moved into the GEMM's epilogue, the residual read as cuBLASLt's C from its own
buffer (C != D, beta 1). TE can only accumulate in place (C = D), which would overwrite the block
input that norm1's backward keeps (dev/NOTES.md); an own cuBLASLt call need not. Prediction:
the epilogue's extra 2 bytes an element read cost 10-20 us a call against the add's 51 us at
ViT-L: per step ViT-B -0.5 to -0.8 ms, ViT-L -1.2 to -1.9, ViT-H -2 to -3. cuBLASLt could also
refuse an out-of-place FP8 GEMM with a bf16 C.
"""

import argparse
import ctypes
from dataclasses import dataclass

import fp8vit  # noqa: F401  imports TE (where installed) before torch runs a cuDNN kernel
import torch
from fp8vit._te.gemm_residual import HeuristicResult, load_cublaslt

from microbench import STEP_ROWS as ROWS, VIT_WIDTHS, per_call_ms

# cuBLASLt's enums (cublasLt.h, cublas_api.h, library_types.h of CUDA 13)
R_32F, R_16BF, R_8F_E4M3, R_8F_E5M2 = 0, 14, 28, 29
COMPUTE_32F, OP_N, OP_T = 68, 0, 1
(DESC_TRANSA, DESC_TRANSB, DESC_EPILOGUE, DESC_BIAS_POINTER, DESC_AUX_POINTER, DESC_AUX_LD,
 DESC_A_SCALE, DESC_B_SCALE, DESC_D_SCALE, DESC_AMAX_D, DESC_AUX_TYPE, DESC_FAST_ACCUM,
 DESC_BIAS_TYPE) = 3, 4, 7, 8, 11, 12, 17, 18, 20, 21, 22, 25, 26
EPI_DEFAULT, EPI_BIAS, EPI_GELU_BIAS, EPI_GELU_AUX_BIAS = 1, 4, 32 | 4, 32 | 128 | 4
PREF_MAX_WORKSPACE = 1
PREF_ALIGNMENT = (5, 6, 7, 8)        # MIN_ALIGNMENT_{A,B,C,D}_BYTES
CONFIG_TILE_ID, CONFIG_STAGES_ID, CONFIG_CLUSTER_SHAPE_ID = 1, 6, 8
WORKSPACE = 32 * 1024 * 1024         # TE's on Hopper (its 1 KiB extra is for NVFP4 scales)
TORCH_DTYPE = {R_32F: torch.float32, R_16BF: torch.bfloat16, R_8F_E4M3: torch.float8_e4m3fn,
               R_8F_E5M2: torch.float8_e5m2}


LT = None


def check(status, what):
    if status != 0:
        raise RuntimeError(f"{what}: cublasStatus {status}")


@dataclass(frozen=True)
class Gemm:
    """``D[n, m] = X[n, k] @ W[m, k]^T`` in row-major terms, the only form Hopper's FP8 GEMMs take
    (cuBLASLt column-major: ``D (m x n) = op_T(A) @ B``). TE's three GEMMs of a Linear map onto it:
    fprop X = the input, W = the weight; dgrad X = the output gradient (E5M2), W = the weight's
    transpose; wgrad X = the output gradient's transpose, W = the input's transpose, k = tokens."""

    name: str
    n: int
    m: int
    k: int
    x_type: int = R_8F_E4M3
    d_type: int = R_16BF
    epilogue: int = EPI_DEFAULT
    fast_accum: bool = True
    main_grad: bool = False       # wgrad written into TE's fp32 main_grad, C = D, beta 0 (overwrite_main_grad)
    reference: bool = False       # not a GEMM of the step: a bound printed beside it
    residual: bool = False        # D = X W^T + bias + R, R a separate bf16 [n, m] (C != D, beta 1)


def block_gemms(C: int, T: int):
    """A ViT block's twelve FP8 GEMMs at width C and T token rows (batch 128: STEP_ROWS), with the
    accumulation fp8vit's delayed recipe gives them (fast forward and dgrad, split wgrad), then two
    reference forms of fc1's forward."""
    H = 4 * C
    shapes = {"qkv": (3 * C, C), "proj": (C, C), "fc1": (H, C), "fc2": (C, H)}   # (out, in)
    out = []
    for lin, (o, i) in shapes.items():
        epi = EPI_GELU_AUX_BIAS if lin == "fc1" else EPI_BIAS
        out.append(Gemm(f"{lin} fprop", T, o, i, epilogue=epi, d_type=R_8F_E4M3 if lin == "fc1" else R_16BF))
    for lin, (o, i) in shapes.items():
        out.append(Gemm(f"{lin} dgrad", T, i, o, x_type=R_8F_E5M2))
    for lin, (o, i) in shapes.items():
        out.append(Gemm(f"{lin} wgrad", o, i, T, x_type=R_8F_E5M2, d_type=R_32F, fast_accum=False, main_grad=True))
    # fc1's forward without its aux output, and with a plain bf16 output: what the epilogue's
    # writes cost, the most another algorithm of the GELU-aux GEMM could win back
    out.append(Gemm("fc1 noaux", T, H, C, epilogue=EPI_GELU_BIAS, d_type=R_8F_E4M3, reference=True))
    out.append(Gemm("fc1 bf16", T, H, C, epilogue=EPI_BIAS, reference=True))
    # lever 61: the residual add after proj and fc2 in their epilogue, read from its own buffer
    for lin in ("proj", "fc2"):
        o, i = shapes[lin]
        out.append(Gemm(f"{lin} +res", T, o, i, epilogue=EPI_BIAS, reference=True, residual=True))
    return out


class LtGemm:
    """One GEMM's cuBLASLt descriptors and buffers, built as TE 2.20's ``cublas_gemm`` builds them
    for per-tensor FP8 inputs; ``run(algo)`` issues it on torch's current stream."""

    def __init__(self, g: Gemm, handle, workspace):
        self.g, self.handle, self.workspace = g, handle, workspace
        torch.manual_seed(0)
        amp = 1e-3 if g.x_type == R_8F_E5M2 else 1.0
        self.x = (torch.randn(g.n, g.k, device="cuda") * amp).to(TORCH_DTYPE[g.x_type])
        self.w = (torch.randn(g.m, g.k, device="cuda") * 0.02 * 64).to(torch.float8_e4m3fn)
        self.d = torch.zeros(g.n, g.m, device="cuda", dtype=TORCH_DTYPE[g.d_type])
        self.bias = torch.randn(g.m, device="cuda", dtype=torch.bfloat16) * 0.1
        self.aux = torch.zeros(g.n, g.m, device="cuda", dtype=torch.bfloat16) if g.epilogue == EPI_GELU_AUX_BIAS else None
        # A's and B's scale_inv, D's scale and amax, each its own allocation as TE's are
        self.scales = [torch.tensor([v], device="cuda") for v in (1 / 64, 1 / amp, 1.0, 0.0)]
        self.a_scale, self.b_scale, self.d_scale, self.d_amax = (ctypes.c_void_p(t.data_ptr()) for t in self.scales)
        self.alpha = ctypes.c_float(1.0)
        # TE's beta: 0 where a GEMM does not accumulate (none of the step's does); 1 with a residual
        self.beta = ctypes.c_float(1.0 if g.residual else 0.0)
        self.c = torch.randn(g.n, g.m, device="cuda", dtype=torch.bfloat16) if g.residual else None

        desc = ctypes.c_void_p()
        check(LT.cublasLtMatmulDescCreate(ctypes.byref(desc), COMPUTE_32F, R_32F), "MatmulDescCreate")
        self.desc = desc
        self._set(DESC_TRANSA, ctypes.c_int32(OP_T))
        self._set(DESC_TRANSB, ctypes.c_int32(OP_N))
        self._set(DESC_FAST_ACCUM, ctypes.c_int8(1 if g.fast_accum else 0))
        self._set(DESC_A_SCALE, self.a_scale)
        self._set(DESC_B_SCALE, self.b_scale)
        c_type = g.d_type
        if g.d_type == R_8F_E4M3:   # TE: no C, C's type the bias's, D's scale and amax
            self._set(DESC_D_SCALE, self.d_scale)
            self._set(DESC_AMAX_D, self.d_amax)
            c_type = R_16BF
        if g.epilogue != EPI_DEFAULT:
            self._set(DESC_BIAS_TYPE, ctypes.c_int32(R_16BF))
            self._set(DESC_BIAS_POINTER, ctypes.c_void_p(self.bias.data_ptr()))
        if self.aux is not None:
            self._set(DESC_AUX_POINTER, ctypes.c_void_p(self.aux.data_ptr()))
            self._set(DESC_AUX_LD, ctypes.c_int64(g.m))
            self._set(DESC_AUX_TYPE, ctypes.c_int32(R_16BF))
        self._set(DESC_EPILOGUE, ctypes.c_int32(g.epilogue))
        self.layouts = [self._layout(t, r, c) for t, r, c in
                        ((R_8F_E4M3, g.k, g.m), (g.x_type, g.k, g.n), (c_type, g.m, g.n), (g.d_type, g.m, g.n))]
        self.c_ptr = None if g.d_type == R_8F_E4M3 else ctypes.c_void_p((self.d if self.c is None else self.c).data_ptr())

    def _set(self, attr, value):
        check(LT.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(value), ctypes.sizeof(value)),
              f"MatmulDescSetAttribute({attr})")

    @staticmethod
    def _layout(dtype, rows, cols):
        lay = ctypes.c_void_p()
        check(LT.cublasLtMatrixLayoutCreate(ctypes.byref(lay), dtype, ctypes.c_uint64(rows), ctypes.c_uint64(cols),
                                            ctypes.c_int64(rows)), "MatrixLayoutCreate")
        return lay

    def algos(self, count):
        """The heuristic's first ``count`` algorithms, in its order (TE runs the first)."""
        pref = ctypes.c_void_p()
        check(LT.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "PreferenceCreate")
        ws = ctypes.c_size_t(WORKSPACE)
        check(LT.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE, ctypes.byref(ws), 8), "pref ws")
        for attr in PREF_ALIGNMENT:   # torch's allocations are 256-byte aligned, as TE reads them
            align = ctypes.c_uint32(256)
            check(LT.cublasLtMatmulPreferenceSetAttribute(pref, attr, ctypes.byref(align), 4), "pref alignment")
        results, got = (HeuristicResult * count)(), ctypes.c_int(0)
        check(LT.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, *self.layouts, pref, count, results,
                                                ctypes.byref(got)), "AlgoGetHeuristic")
        LT.cublasLtMatmulPreferenceDestroy(pref)
        return [results[i] for i in range(got.value) if results[i].state == 0]

    def run(self, res):
        check(LT.cublasLtMatmul(self.handle, self.desc, ctypes.byref(self.alpha), ctypes.c_void_p(self.w.data_ptr()),
                                self.layouts[0], ctypes.c_void_p(self.x.data_ptr()), self.layouts[1],
                                ctypes.byref(self.beta), self.c_ptr, self.layouts[2],
                                ctypes.c_void_p(self.d.data_ptr()), self.layouts[3], ctypes.byref(res.algo),
                                ctypes.c_void_p(self.workspace.data_ptr()), ctypes.c_size_t(WORKSPACE),
                                ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)), "Matmul")

    def output(self, res):
        """One call's result (as float) from a zeroed D, for comparing algorithms: the bf16 aux
        where D is FP8 (one FP8 step is 6-12% of a value, the aux is the unrounded pre-GELU)."""
        self.d.zero_()
        self.run(res)
        return (self.aux if self.aux is not None else self.d).float().clone()


def reference_error(lt: "LtGemm", got: torch.Tensor) -> float:
    """The largest difference of ``got`` (what ``LtGemm.output`` returns) from the same GEMM in
    fp32 by torch, relative to the largest value: shows the rebuilt descriptors compute the GEMM
    (scales, bias, residual) and not only take its time."""
    g = lt.g
    want = (lt.x.float() * lt.scales[1]) @ (lt.w.float() * lt.scales[0]).T
    if g.epilogue != EPI_DEFAULT:
        want += lt.bias.float()
    if lt.c is not None:
        want += lt.c.float()
    if g.epilogue == EPI_GELU_BIAS:   # D is the GELU itself (TE's tanh form; FP8-rounded)
        want = torch.nn.functional.gelu(want, approximate="tanh")
    return float((got - want).abs().max() / want.abs().max())


def algo_name(res):
    """Tile, stages and cluster ids of an algorithm: enough to tell two apart in the log."""
    vals = []
    for attr, ctype in ((CONFIG_TILE_ID, ctypes.c_uint32), (CONFIG_STAGES_ID, ctypes.c_uint32),
                        (CONFIG_CLUSTER_SHAPE_ID, ctypes.c_uint16)):
        v, written = ctype(0), ctypes.c_size_t(0)
        LT.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(res.algo), attr, ctypes.byref(v), ctypes.sizeof(v),
                                                ctypes.byref(written))
        vals.append(v.value)
    return "tile {} stages {} cluster {}".format(*vals)


def te_time(g: Gemm):
    """TE's own call of the same GEMM (``general_gemm``, layout "TN" as Hopper runs every FP8
    GEMM), its per-call ms: should equal the heuristic's first algorithm's. None for the wgrad
    form (TE writes it into ``main_grad``, a path this does not rebuild), a GELU without aux and a
    residual read from its own buffer (TE has neither)."""
    if g.main_grad or g.residual or g.epilogue == EPI_GELU_BIAS:
        return None
    from fp8vit._te import te_module
    tex = te_module("transformer_engine_torch")
    quantizer = te_module("transformer_engine.pytorch.tensor.float8_tensor").Float8Quantizer
    gemm = te_module("transformer_engine.pytorch.cpp_extensions").general_gemm

    def fp8(rows, cols, dtype):
        scale, amax = torch.ones(1, device="cuda"), torch.zeros(1, device="cuda")
        return quantizer(scale, amax, dtype, columnwise=False)(torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16))

    w = fp8(g.m, g.k, tex.DType.kFloat8E4M3)
    x = fp8(g.n, g.k, tex.DType.kFloat8E4M3 if g.x_type == R_8F_E4M3 else tex.DType.kFloat8E5M2)
    kwargs = dict(out_dtype=torch.bfloat16, use_split_accumulator=not g.fast_accum, layout="TN")
    if g.epilogue != EPI_DEFAULT:
        kwargs["bias"] = torch.zeros(g.m, device="cuda", dtype=torch.bfloat16)
    if g.epilogue == EPI_GELU_AUX_BIAS:
        out_q = quantizer(torch.ones(1, device="cuda"), torch.zeros(1, device="cuda"), tex.DType.kFloat8E4M3,
                          columnwise=False)
        kwargs.update(gelu=True, quantization_params=out_q)
    return per_call_ms(lambda: gemm(w, x, **kwargs), calls=10, reps=20)


def _runs(lt: "LtGemm", res) -> bool:
    try:
        lt.run(res)
        torch.cuda.synchronize()
        return True
    except RuntimeError as err:
        print(f"  {lt.g.name}: an algorithm failed ({err})")
        return False


def residual_add(model, C, depth, firsts):
    """Lever 61's answer: proj's and fc2's forward GEMM then torch's residual add (today) against
    the GEMM reading the residual in its epilogue (``+res``), per call and per step (two a block)."""
    if not all(k in firsts for k in ("proj fprop", "fc2 fprop", "proj +res", "fc2 +res")):
        return
    a, b = (torch.randn(ROWS, C, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty_like(a)
    add = per_call_ms(lambda: torch.add(a, b, out=out), calls=10, reps=20)
    per_step = 0.0
    for lin in ("proj", "fc2"):
        today, fused = firsts[f"{lin} fprop"] + add, firsts[f"{lin} +res"]
        per_step += (today - fused) * depth
        print(f"{model} {lin}: GEMM + add {today * 1e3:6.1f} us (add {add * 1e3:.1f}), residual in the epilogue "
              f"{fused * 1e3:6.1f} us")
    print(f"{model}: the residual in proj's and fc2's epilogue would save {per_step:.2f} ms a step (first algorithms)")


def main():
    global LT
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(VIT_WIDTHS), choices=list(VIT_WIDTHS))
    parser.add_argument("--algos", type=int, default=16, help="how many of the heuristic's algorithms to time")
    args = parser.parse_args()
    LT = load_cublaslt()  # fp8vit's: the cuBLASLt torch loaded, with the calls' argument types
    handle = ctypes.c_void_p()
    check(LT.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    workspace = torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuBLASLt {LT.cublasLtGetVersion()}, "
          f"T = {ROWS} rows; per call: the heuristic's first algorithm (TE's), TE's own call, the best of "
          f"up to {args.algos} (its rank, max rel. difference of its output from the first's)")
    for model in args.models:
        C, depth = VIT_WIDTHS[model]
        saved = first_total = 0.0
        firsts = {}
        for g in block_gemms(C, ROWS):
            try:
                lt = LtGemm(g, handle, workspace)
                algos = lt.algos(args.algos)
                if not algos:
                    raise RuntimeError("the heuristic returned no algorithm")
            except RuntimeError as err:   # cuBLASLt without a kernel for this form: say so, go on
                print(f"{model} {g.name:11s}: refused ({err})")
                continue
            try:   # an algorithm may refuse at run time what its descriptor allows (C != D): skip it
                head = next(i for i, res in enumerate(algos) if _runs(lt, res))
            except StopIteration:
                print(f"{model} {g.name:11s}: every algorithm failed at run time")
                continue
            ref = lt.output(algos[head])
            error = reference_error(lt, ref)
            # an algorithm that computes something else is no choice; where D is FP8 with no aux to
            # compare, one E4M3 step (up to 1/8 of the largest value) is a rounding, not an error
            tol = 0.13 if g.d_type == R_8F_E4M3 and lt.aux is None else 1e-2
            times = []
            for rank, res in list(enumerate(algos))[head:]:
                try:
                    diff = float((lt.output(res) - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
                    times.append((per_call_ms(lambda r=res, lt=lt: lt.run(r), calls=10, reps=20), rank, diff, res))
                except RuntimeError as err:
                    print(f"  {g.name}: algorithm {rank} failed ({err})")
            first = next(t for t in times if t[1] == head)   # TE's choice: rank 0 (where it runs)
            best = min((t for t in times if t[1] == head or t[2] <= tol), key=lambda t: t[0])
            te = te_time(g)
            te_txt = f"TE {te * 1e3:6.1f}" if te is not None else "TE    n/a"
            print(f"{model} {g.name:11s} n={g.n:5d} m={g.m:4d} k={g.k:5d}: first {first[0] * 1e3:6.1f} us "
                  f"({algo_name(first[3])}), {te_txt}, best {best[0] * 1e3:6.1f} us (rank {best[1]:2d}, "
                  f"{algo_name(best[3])}, diff {best[2]:.1e}), {len(times)} timed; first vs fp32 torch {error:.1e}")
            if not g.reference:
                saved += (first[0] - best[0]) * depth
                first_total += first[0] * depth
            firsts[g.name] = first[0]
        print(f"{model}: the step's FP8 GEMMs {first_total:.2f} ms with the first algorithms; the best would save "
              f"{saved:.2f} ms ({100 * saved / first_total:.1f}%)")
        residual_add(model, C, depth, firsts)


if __name__ == "__main__":
    main()
