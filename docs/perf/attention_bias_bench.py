"""Attention with a learned additive bias (Swin's and BEiT's relative position bias), forward +
backward with the bias gradient, per kernel path, at Swin-B's and BEiT-B's shapes (batch 128).

    python3 docs/perf/attention_bias_bench.py        # on the GPU machine, TE installed

Why: the first graphed Swin-B step with fp8vit's fused block (H200) spent 64.3 of 115 ms in
attention, 39.1 ms of it in cuDNN's ``fmha_dbias`` kernel (TE's post_scale_bias gradient, the
``[1, H, N, N]`` bias summed over the batch of windows: up to 8192 x 4 x 49 x 49 per call)
(``docs/results/profile/swin_base_patch4_window7_224_b128_fp8vit-fp8-delayed-graphed_h200.kernels.txt``).
Which path gives the bias gradient cheapest?

  te-dbias        TE DotProductAttention, bias [1, H, N, N] as post_scale_bias, its gradient
                  from cuDNN (fp8vit's TE_SwinBlock and TE_BeitBlock today)
  te-bias-const   the same, the bias without gradient (no dbias kernel): the floor of TE's path
  te-nobias       TE, no bias
  sdpa-efficient  torch SDPA, memory-efficient kernel, attn_mask the bias expanded to [B, H, N, N]
                  (a stride-0 view; its gradient summed back by autograd)
  sdpa-aligned    the same kernel, the bias passed as fp8vit passes it (``blocks.base._sdpa_bias``):
                  [1, H, N, N] in a [1, H, N, 64] buffer (strides multiples of 16), unexpanded, so
                  that SDPA does not pad a copy of the batch-expanded bias per call
  sdpa-cudnn      torch SDPA on its cuDNN backend, the same mask (may refuse the bias gradient)
  compiled        torch.compile of softmax(q k^T * s + bias) v in [B, H, N, D] (Inductor: two
                  GEMMs and a fused bias + softmax kernel; the bias gradient a reduction)
  eager           the same, eager (what TE's unfused backend does)
Each path's output, dq and dbias are checked against an fp32 reference (max error relative to the
reference's largest value). Times: fp8vit.tools.timing.median_ms, one forward + backward per call
(the host waits for each), median of 30 after 10 warm-up.

Per step: Swin-B/4 w7 224 has 2, 2, 18, 2 blocks at 64, 16, 4, 1 windows x 128 images of 49 tokens,
4, 8, 16, 32 heads of 32 (a shifted block runs its windows in up to 4 calls of the same total
size: counted as one call here); BEiT-B/16 224 12 blocks of 128 x 197 tokens, 12 heads of 64.

Prediction (written before the run): te-dbias ~0.7 ms per Swin stage-1 call (39 ms / 57 calls on
average); te-bias-const 3-5x faster; sdpa-efficient and compiled within 2x of te-bias-const, so
that a Swin-B step saves 20-30 ms by taking the bias gradient outside cuDNN. BEiT-B: te-dbias
about 0.4 ms per block more than te-bias-const (the 5-6 ms BEiT's graphed step was slower than
predicted).

Prediction for sdpa-aligned (added after the first run, in which sdpa-efficient was 2.33 ms per Swin
stage-1 call): SDPA's pad of the expanded bias zero-fills and copies [8192, 4, 49, 56] bf16 (180 MB
twice) and saves it for backward; without it, 1.5-1.9 ms per stage-1 call, and the Swin-B step's
attention (23.0 ms summed over the stages) -3 to -5 ms.
"""

import math

import fp8vit  # noqa: F401  imports TE before torch runs a cuDNN kernel
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fp8vit.blocks.base import _sdpa_bias
from microbench import max_rel_err, timed_or_refused

SHAPES = {  # name: (rows, tokens, heads, head dim, calls per step)
    "Swin-B stage 1": (64 * 128, 49, 4, 32, 2),
    "Swin-B stage 2": (16 * 128, 49, 8, 32, 2),
    "Swin-B stage 3": (4 * 128, 49, 16, 32, 18),
    "Swin-B stage 4": (1 * 128, 49, 32, 32, 2),
    "BEiT-B": (128, 197, 12, 64, 12),
}


def reference(q, k, v, bias):
    """fp32 softmax(q k^T / sqrt(D) + bias) v; q, k, v [B, N, H, D], bias [1, H, N, N]."""
    q, k, v = (t.float().transpose(1, 2) for t in (q, k, v))
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias.float()
    return (s.softmax(-1) @ v).transpose(1, 2).flatten(2)  # [B, N, H*D]


def manual(q, k, v, bias):
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5) + bias
    return (s.float().softmax(-1).to(q.dtype) @ v).transpose(1, 2).flatten(2)


def sdpa(backend):
    def run(q, k, v, bias):
        b = bias.expand(q.shape[0], -1, -1, -1)
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=b)
        return o.transpose(1, 2).flatten(2)
    return run


def sdpa_aligned(q, k, v, bias):
    mask = _sdpa_bias(bias, q.dtype)  # the library's own, so that this measures what it runs
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return o.transpose(1, 2).flatten(2)


def te_path(heads, dim, with_bias):
    import transformer_engine.pytorch as te

    attn = te.DotProductAttention(heads, dim, qkv_format="bshd", attn_mask_type="no_mask")

    def run(q, k, v, bias):
        if not with_bias:
            return attn(q, k, v)
        return attn(q, k, v, core_attention_bias_type="post_scale_bias", core_attention_bias=bias)
    return run


def main():
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    print(f"{'shape':15s} {'path':15s} {'fwd+bwd ms':>10s} {'per step ms':>11s}   max err: out, dq, dbias (vs fp32)")
    totals = {}
    for name, (B, N, H, D, calls) in SHAPES.items():
        q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        bias0 = torch.randn(1, H, N, N, device="cuda") * 2
        g = torch.randn(B, N, H * D, device="cuda", dtype=torch.bfloat16)
        qr, kr, vr = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        br = bias0.clone().requires_grad_(True)
        reference(qr, kr, vr, br).backward(g.float())
        paths = {"te-dbias": (te_path(H, D, True), True), "te-bias-const": (te_path(H, D, True), False),
                 "te-nobias": (te_path(H, D, False), False),
                 "sdpa-efficient": (sdpa(SDPBackend.EFFICIENT_ATTENTION), True), "sdpa-aligned": (sdpa_aligned, True),
                 "sdpa-cudnn": (sdpa(SDPBackend.CUDNN_ATTENTION), True),
                 "compiled": (torch.compile(manual), True), "eager": (manual, True)}
        for path, (fn, bias_grad) in paths.items():
            qi, ki, vi = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
            bias = bias0.to(torch.bfloat16).requires_grad_(bias_grad)

            def step():
                qi.grad = ki.grad = vi.grad = bias.grad = None
                fn(qi, ki, vi, bias).backward(g)
            ms = timed_or_refused(step, f"{name:15s} {path:15s}")
            if ms is None:
                continue
            out = fn(qi, ki, vi, bias)
            errs = [max_rel_err(out, reference(q, k, v, bias0).detach()), max_rel_err(qi.grad, qr.grad)]
            errs.append(max_rel_err(bias.grad, br.grad) if bias_grad else float("nan"))
            if name.startswith("Swin"):
                totals[path] = totals.get(path, 0.0) + calls * ms
            print(f"{name:15s} {path:15s} {ms:10.3f} {calls * ms:11.2f}   " + ", ".join(f"{e:.1e}" for e in errs))
    print("Swin-B attention per step (sum of the stages' calls x blocks), by path: "
          + ", ".join(f"{p} {t:.1f} ms" for p, t in totals.items()))


if __name__ == "__main__":
    main()
