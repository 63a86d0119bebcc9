"""Depthwise 3x3 convolution, forward + backward (input and weight gradients), per memory layout and
kernel library, at ViTamin-L/224's six MbConv depthwise convs (batch 64, bf16).

    python3 docs/perf/depthwise_conv_bench.py        # on the GPU machine

Why: ViTamin-L b64 graphed + compile (docs/results/profile/vitamin_large_224_b64_fp8vit-fp8-delayed-
graphed-compile_h200.kernels.txt) spends 6.1 ms a step in cuDNN's channels-last depthwise kernels
(dgrad2d_c1_k1_nhwc 3.51 ms, wgrad2d_c1_k1_nhwc 1.43, conv2d_c1_k1_nhwc 1.21; 6 calls each),
about 4x the time their bytes need at the H200's bandwidth: Inductor lays the conv stages out
channels-last. Which layout and library runs them fastest?

  nchw-cudnn     contiguous NCHW input and weight, cuDNN (timm eager's layout)
  nhwc-cudnn     channels-last input and weight, cuDNN (what the compiled model runs)
  nchw-native    NCHW with cuDNN off: ATen's own depthwise kernels (conv_depthwise2d)
  nhwc-native    channels-last with cuDNN off
  nhwc-shifted-compile  channels-last, the conv as 9 shifted products (``shifted`` below) under
                 torch.compile (lever 47: Inductor's own fused kernels)
Each path's output, input and weight gradients are checked against an fp32 NCHW reference (max
error relative to the reference's largest value). Times: fp8vit.tools.timing.median_ms, one
forward + backward per call (the host waits for each), median of 30 after 10 warm-up
(microbench.py).

Prediction (written before the first run): nhwc-cudnn about 1 ms per call on average (6.1 ms / 6),
nchw-cudnn 1.5-2.5x faster, so that keeping these convs NCHW would save 2-3.5 ms of ViTamin-L's
79.6 ms step (to 1.80-1.83x timm eager); the native kernels between the two.
Measured (H100, ``results/levers/depthwise_conv_vitamin_l_h100.log``): per step nhwc-cudnn 7.08 ms,
nchw-cudnn 29.42 (4.2x slower), nhwc-native 19.34, nchw-native 29.50: wrong way round; cuDNN's
channels-last kernels are already the fastest here, so lever 46 is dropped (no A/B run).

Lever 47 (nhwc-shifted-compile, written before its run): the convs' bytes (forward: input + output;
input gradient: output gradient + input; weight gradient: both again) need ~3.3 ms a step at ~2.9
TB/s; Inductor's kernels from the shifted products should reach 60-90% of that: 3.7-5.5 ms a step
against nhwc-cudnn's 7.1 (1.3-1.9x faster). Risk: the weight gradient as 9 reductions that each
re-read the output gradient (then slower than cuDNN). In the model Inductor also fuses the bias
and the GELU after it; the step (ViTamin-L b64 graphed + compile, ``-dwshift-``) -1.5 to -3 ms.
Measured (H100, ``results/levers/depthwise_conv_vitamin_l_lever47_h100.log``): 24.9 ms a step against
nhwc-cudnn's 7.45 (3.3x slower); the step 86.6 -> 117.1 ms (``results/bench/vitamin_large_224_b64_
lever47_h100.log``). Lever 47 is dropped; its module and ``-dwshift-`` variants left with commit 911413f.
"""

import fp8vit  # noqa: F401  imports TE (where installed) before torch runs a cuDNN kernel
import torch
import torch.nn.functional as F

from microbench import max_rel_err, timed_or_refused

BATCH = 64
SHAPES = {  # name: (channels, input height = width, stride), as timm's vitamin_large_224 builds them
    "stage 0.0": (640, 112, 2),
    "stage 0.1": (640, 56, 1),
    "stage 1.0": (1280, 56, 2),
    "stage 1.1-1.3": (1280, 28, 1),  # three calls a step
}
CALLS = {"stage 1.1-1.3": 3}


def shifted(x, w, stride):
    """``F.conv2d(x, w, stride=stride, padding=1, groups=C)`` for 3x3 ``w`` ``[C, 1, 3, 3]``, as the
    sum of 9 shifted slices of the zero-padded input, each times its channel's tap, in fp32."""
    c, h, wd = x.shape[1:]
    oh, ow = (h - 1) // stride + 1, (wd - 1) // stride + 1
    xp, wf = F.pad(x, (1, 1, 1, 1)), w.float().view(c, 9)
    out = 0
    for i in range(3):
        for j in range(3):  # the input pixels that tap (i, j) of every output pixel reads: [B, C, OH, OW]
            tap = xp[:, :, i:i + stride * (oh - 1) + 1:stride, j:j + stride * (ow - 1) + 1:stride]
            out = out + tap.float() * wf[:, 3 * i + j].view(1, c, 1, 1)
    return out.to(x.dtype)


def paths():
    def run(layout, cudnn):
        fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format

        def prepare(x, w):
            return x.contiguous(memory_format=fmt), w.contiguous(memory_format=fmt)

        def fn(x, w, stride):
            with torch.backends.cudnn.flags(enabled=cudnn):
                return F.conv2d(x, w, stride=stride, padding=1, groups=w.shape[0])
        return prepare, fn
    found = {f"{layout}-{'cudnn' if cudnn else 'native'}": run(layout, cudnn)
             for cudnn in (True, False) for layout in ("nchw", "nhwc")}
    prepare, _ = run("nhwc", True)
    found["nhwc-shifted-compile"] = (prepare, torch.compile(shifted, dynamic=False))
    return found


def main():
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    print(f"{'shape':14s} {'path':12s} {'fwd+bwd ms':>10s} {'per step ms':>11s}   max err: out, dx, dw (vs fp32)")
    totals = {}
    for name, (C, S, stride) in SHAPES.items():
        calls = CALLS.get(name, 1)
        x0 = torch.randn(BATCH, C, S, S, device="cuda")
        w0 = torch.randn(C, 1, 3, 3, device="cuda") * 0.3
        xr, wr = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        ref = F.conv2d(xr, wr, stride=stride, padding=1, groups=C)
        g = torch.randn_like(ref)
        ref.backward(g)
        gb = g.to(torch.bfloat16)
        for path, (prepare, fn) in paths().items():
            x, w = prepare(x0.to(torch.bfloat16), w0.to(torch.bfloat16))
            x.requires_grad_(True)
            w.requires_grad_(True)
            grad = gb.contiguous(memory_format=torch.channels_last) if path.startswith("nhwc") else gb

            def step():
                x.grad = w.grad = None
                fn(x, w, stride).backward(grad)
            ms = timed_or_refused(step, f"{name:14s} {path:12s}")
            if ms is None:
                continue
            out = fn(x, w, stride)
            errs = [max_rel_err(out, ref.detach()), max_rel_err(x.grad, xr.grad), max_rel_err(w.grad, wr.grad)]
            totals[path] = totals.get(path, 0.0) + calls * ms
            print(f"{name:14s} {path:12s} {ms:10.3f} {calls * ms:11.2f}   " + ", ".join(f"{e:.1e}" for e in errs))
        del x0, xr, ref, g, gb
        torch.cuda.empty_cache()
    print("ViTamin-L depthwise convs per step (forward + backward), by path: "
          + ", ".join(f"{p} {t:.2f} ms" for p, t in totals.items()))


if __name__ == "__main__":
    main()
