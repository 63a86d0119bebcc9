"""Lever 69 (docs/performance.md), its microbenchmark: a LayerNorm forward that writes its FP8 output
and that output's transpose in one Triton pass, against TE's ``layernorm_fwd``.

    python3 docs/perf/ln_cast_transpose_bench.py      # GPU machine, TE installed

Why: in a graphed ViT step each ``LayerNormLinear`` / ``LayerNormMLP`` forward (qkv's norm1, fc1's
norm2) asks TE's ``layernorm_fwd`` for an FP8 output with both usages: the norm kernel writes the
rowwise FP8 bytes, then a transpose kernel reads them back and writes the columnwise copy for the
weight gradient (ViT-L/16 b128 on an H100: 36 + 15 us a call, 48 calls a step;
``results/profile/vit_large*_sync_h100.kernels.txt``). One pass that keeps a tile of rows on chip
writes both and never reads the FP8 bytes again: 2 + 1 + 1 bytes an element against 2 + 1 + 1 + 1,
and one launch fewer. If it wins, the library would route ``tex.layernorm_fwd`` to it where it
applies (per-tensor delayed scaling, both usages, bf16 in), as lever 49 routes ``bgrad_quantize``.

Timed per call in a CUDA graph (``microbench.per_call_ms``): TE's own kernels, TE with cuDNN's
LayerNorm (``fp8vit.set_cudnn_layernorm``: the graphs' choice at widths TE has no tuned kernel for), and the Triton pass at a
few launch shapes. Checked against TE's: the FP8 bytes (the share equal; a byte off where the two
variance sums round apart), mu and rsigma, the transpose byte for byte, the amax.

Prediction (written before the first run): TE ~51 us a call at ViT-L, the Triton pass 40-46 us:
ViT-L -0.25 to -0.5 ms a step (48 calls), ViT-B -0.1 to -0.2 (24), ViT-H -0.4 to -0.8 (64), less
under the 700 W cap. Under -0.3 ms at ViT-L on paper the lever stops here.
"""

import argparse

import fp8vit  # first: imports TE (where installed) before torch runs a cuDNN kernel
import torch
import triton
import triton.language as tl

from fp8vit._te import te_module, te_version
from fp8vit.training.numerics import E4M3_MAX
from microbench import STEP_ROWS as ROWS, VIT_WIDTHS, per_call_ms, residual_stream

# (BLOCK_R, warps): a program holds BLOCK_R whole rows in registers. Whole rows, read once: a
# pass per column chunk would read x again, and 400 resident programs of 64 rows span the whole
# 50 MB input, as much as the L2 holds, so the second pass would go to HBM.
CONFIGS = [(16, 4), (16, 8), (32, 8), (32, 16), (8, 4), (8, 8)]


@triton.jit
def ln_cast_transpose_kernel(X, W, B, Q, QT, MU, RSIGMA, SCALE, AMAX, SCALE_INV, R, C, eps, BLOCK_R: tl.constexpr,
                             CP: tl.constexpr):
    # BLOCK_R rows of X [R, C] (bf16), all C columns (CP: the next power of two): mean, then the
    # variance about it (two passes in registers, as TE's kernel), y = (x - mu) * rsigma * W + B;
    # Q [R, C] and QT [C, R] get y * SCALE in E4M3 (saturated), AMAX rises to max |y|, MU and RSIGMA
    # (fp32 [R]) are what TE's backward reads, SCALE_INV gets 1 / SCALE (IEEE division, as TE's).
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, CP)
    live = rows < R
    cm = cols < C
    m = live[:, None] & cm[None, :]
    x = tl.load(X + rows[:, None].to(tl.int64) * C + cols[None, :], mask=m, other=0.0).to(tl.float32)
    mu = tl.sum(x, axis=1) / C
    d = tl.where(m, x - mu[:, None], 0.0)
    rsigma = 1.0 / tl.sqrt_rn(tl.sum(d * d, axis=1) / C + eps)
    tl.store(MU + rows, mu, mask=live)
    tl.store(RSIGMA + rows, rsigma, mask=live)
    w = tl.load(W + cols, mask=cm, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=cm, other=0.0).to(tl.float32)
    y = tl.where(m, d * rsigma[:, None] * w[None, :] + b[None, :], 0.0)
    tl.atomic_max(AMAX, tl.max(tl.max(tl.abs(y), axis=1), axis=0))
    v = y * tl.load(SCALE)
    v = tl.where(v > 448.0, 448.0, tl.where(v < -448.0, -448.0, v))
    q = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    tl.store(Q + rows[:, None].to(tl.int64) * C + cols[None, :], q, mask=m)
    tl.store(QT + cols[None, :].to(tl.int64) * R + rows[:, None], q, mask=m)
    if tl.program_id(0) == 0:
        tl.store(SCALE_INV, 1.0 / tl.load(SCALE))


def triton_ln(x, w, b, eps, q, qt, mu, rsigma, scale, amax, scale_inv, cfg):
    block_r, warps = cfg
    R, C = x.shape
    ln_cast_transpose_kernel[(triton.cdiv(R, block_r),)](x, w, b, q, qt, mu, rsigma, scale, amax, scale_inv, R, C, eps,
                                                         block_r, triton.next_power_of_2(C), num_warps=warps)


def kernel_bench(tex, f8):
    f8 = te_module("transformer_engine.pytorch.tensor.float8_tensor").Float8Quantizer
    eps = 1e-6
    best = {}  # width -> the fastest launch shape
    for name, (C, depth) in VIT_WIDTHS.items():
        torch.manual_seed(0)
        x, w, b = residual_stream(C)
        ref_y = torch.nn.functional.layer_norm(x.float(), (C,), w.float(), b.float(), eps)
        scale = torch.tensor([E4M3_MAX / float(ref_y.abs().max()) / 2], device="cuda")
        quant = f8(scale=scale.clone(), amax=torch.zeros(1, device="cuda"), fp8_dtype=tex.DType.kFloat8E4M3,
                   rowwise=True, columnwise=True)

        def te_ln():
            return tex.layernorm_fwd(x, w, b, eps, None, quant, tex.DType.kBFloat16, 0, False)

        times = {}
        for backend, on in (("TE", False), ("TE cuDNN", True)):
            fp8vit.set_cudnn_layernorm(on)  # TE's switch, process-wide (its core library reads the variable once)
            try:
                times[backend] = per_call_ms(te_ln) * 1e3
            except Exception as err:  # cuDNN's LayerNorm can refuse: say so, go on
                print(f"{name}: {backend} failed: {type(err).__name__}: {str(err)[:150]}")
        fp8vit.set_cudnn_layernorm(False)
        te_out, te_mu, te_rs = te_ln()
        te_q = te_out._data
        assert te_out._transpose is not None and not te_out._transpose_invalid, "TE wrote no transpose"
        best_te = min(times.values())
        print(f"{name} R={ROWS} C={C}: " + ", ".join(f"{k} {v:.1f} us" for k, v in times.items()))

        q = torch.empty(ROWS, C, device="cuda", dtype=torch.uint8)
        qt = torch.empty(C, ROWS, device="cuda", dtype=torch.uint8)
        mu = torch.empty(ROWS, device="cuda")
        rs = torch.empty(ROWS, device="cuda")
        amax = torch.zeros(1, device="cuda")
        scale_inv = torch.empty(1, device="cuda")
        results = []
        for cfg in CONFIGS:
            args = (x, w, b, eps, q, qt, mu, rs, scale, amax, scale_inv, cfg)
            try:
                t = per_call_ms(lambda: triton_ln(*args)) * 1e3
            except Exception as err:  # a launch shape this Triton cannot compile or fit
                print(f"  Triton {cfg}: failed: {type(err).__name__}: {str(err)[:150]}")
                continue
            amax.zero_()
            triton_ln(*args)
            same = float((q == te_q).float().mean())
            off = (q.to(torch.int16) - te_q.to(torch.int16)).abs().max().item()
            mu_err = float((mu - te_mu).abs().max() / te_mu.abs().max())
            rs_err = float(((rs - te_rs).abs() / te_rs).max())
            t_ok = bool(torch.equal(qt, q.t()))
            te_t_ok = bool(torch.equal(te_out._transpose, te_q.t()))
            amax_err = float((amax - ref_y.abs().max()).abs() / ref_y.abs().max())
            sinv_ok = bool(torch.equal(scale_inv, te_out._scale_inv.view(1)))
            print(f"  Triton {cfg}: {t:.1f} us ({t - best_te:+.1f} vs TE's best, {(t - best_te) * 2 * depth / 1e3:+.2f} "
                  f"ms a step, {2 * depth} calls); FP8 bytes equal to TE's {same:.5f} (max {off} apart), mu rel "
                  f"{mu_err:.1e}, rsigma rel {rs_err:.1e}, transpose equal {t_ok} (TE's {te_t_ok}), amax rel {amax_err:.1e}, "
                  f"scale_inv equal {sinv_ok}")
            results.append((t, cfg))
        if results:
            best[C] = min(results)[1]
    return best


def routed_layernorm_fwd(te_fn, best, counts):
    """``tex.layernorm_fwd`` on the Triton pass where it applies (no ``ln_out`` given, a per-tensor
    E4M3 quantizer wanting both usages, bf16 contiguous input, weight and bias, no zero-centred
    gamma), TE's function otherwise; ``best``: the launch shape per width (:func:`kernel_bench`'s),
    ``counts`` tallies both."""
    tex = te_module("transformer_engine_torch")
    f8 = te_module("transformer_engine.pytorch.tensor.float8_tensor").Float8Quantizer

    def layernorm_fwd(*args, **kwargs):
        if len(args) == 9 and not kwargs:
            inp, weight, bias, eps, ln_out, quantizer, _, _, zero_centered = args
            if (ln_out is None and type(quantizer) is f8 and quantizer.rowwise_usage and quantizer.columnwise_usage
                    and quantizer.dtype == tex.DType.kFloat8E4M3 and not zero_centered and bias is not None
                    and inp.is_cuda and inp.is_contiguous() and weight.is_contiguous() and bias.is_contiguous()
                    and inp.dtype == weight.dtype == bias.dtype == torch.bfloat16):
                counts["triton"] += 1
                C = inp.shape[-1]
                x = inp.view(-1, C)
                out = quantizer.make_empty(inp.shape, dtype=inp.dtype, device=inp.device)
                mu = torch.empty(x.shape[0], device=inp.device)
                rsigma = torch.empty(x.shape[0], device=inp.device)
                triton_ln(x, weight, bias, eps, out._data.view(-1, C), out._transpose.view(C, -1), mu, rsigma,
                          quantizer.scale, quantizer.amax, out._scale_inv, best.get(C, CONFIGS[0]))
                out._transpose_invalid = False
                return [out, mu, rsigma]
        counts["te"] += 1
        return te_fn(*args, **kwargs)

    return layernorm_fwd


def step_ab(model, batch, best, rounds):
    """A graphed fp8vit step with TE's LayerNorm forwards against one whose graphs captured the
    Triton pass in their place: both built and warmed up, then ``rounds`` synchronized steps each,
    in turn (a drift falls on both alike)."""
    from fp8vit.tools.timing import Stopwatch
    from fp8vit.tools.workload import build_workload, make_optimizer, synthetic_batch, train_step_fn

    tex = te_module("transformer_engine_torch")
    te_fn = tex.layernorm_fwd
    runs = {}
    for name in ("TE", "Triton"):
        torch.manual_seed(0)
        counts = {"triton": 0, "te": 0}
        tex.layernorm_fwd = routed_layernorm_fwd(te_fn, best, counts) if name == "Triton" else te_fn
        try:
            wl = build_workload(model, "fp8vit-fp8-delayed-graphed", batch_size=batch)
            step = train_step_fn(wl, make_optimizer(wl.model.parameters(), "sgd", lr=1e-3))
            x, y = synthetic_batch(batch, wl)
            for _ in range(4):  # the graphs are captured at the second step
                loss = step(x, y)
        finally:
            tex.layernorm_fwd = te_fn
        print(f"{name}: LayerNorm forwards while building and capturing: {counts}; warm-up loss {float(loss):.4f}")
        runs[name] = (step, x, y, [])
    for i in range(rounds):
        for name in (("TE", "Triton") if i % 2 == 0 else ("Triton", "TE")):
            step, x, y, times = runs[name]
            watch = Stopwatch("cuda").start()
            step(x, y)
            times.append(watch.elapsed_ms())
    med = {name: sorted(r[3])[len(r[3]) // 2] for name, r in runs.items()}
    print(f"{model} b{batch} graphed, {rounds} synchronized steps each in turn, median: TE {med['TE']:.2f} ms, "
          f"Triton LayerNorm {med['Triton']:.2f} ms ({med['Triton'] - med['TE']:+.2f} ms)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--step", nargs="*", default=[], metavar="MODEL",
                        help="also time graphed steps of these timm models (batch 128), TE's LayerNorm "
                             "against the Triton pass, in turn")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    tex = te_module("transformer_engine_torch")
    f8 = te_module("transformer_engine.pytorch.tensor.float8_tensor").Float8Quantizer
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, TE {te_version()}, Triton {triton.__version__}")
    best = kernel_bench(tex, f8)
    print(f"fastest launch shape per width: {best}")
    for model in args.step:
        step_ab(model, 128, best, args.rounds)


if __name__ == "__main__":
    main()
