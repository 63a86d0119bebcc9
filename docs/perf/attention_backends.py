"""Lever 50's microbenchmark: the classic ViT's attention (no mask, no bias, 197 tokens), forward +
backward, by kernel path and QKV layout, at ViT-B/16's, ViT-L/16's and ViT-H/16's shapes (batch 128).

    python3 docs/perf/attention_backends.py        # on the GPU machine, TE installed

Why: attention is the largest cost after the FP8 GEMMs in a graphed step (H100, synchronized
profile: ViT-L/16 13.9 of 81.8 ms, cuDNN's flash forward and backward plus the backward's
dO.O and dQ-conversion passes), at about 160 TFLOP/s: 197 tokens fill 64-row tiles poorly.
fp8vit runs TE's DotProductAttention (cuDNN) on q, k, v viewed out of the packed qkv GEMM output
[B, N, 3, H, D]. Does another layout or torch's SDPA backends run the same attention faster?

  te-packed        TE, bshd, q k v views of the packed [B, N, 3, H, D] buffer, the gradient back
                   through fp8vit's SplitQKV (TE writes dq dk dv packed: fp8vit's path)
  te-separate      TE, bshd, q k v three contiguous [B, N, H, D] tensors
  sdpa-cudnn-packed  torch SDPA's cuDNN backend on the packed views, through SplitQKV (it stacks
                   the three gradients: one copy)
  sdpa-*           torch SDPA's cuDNN, flash (FlashAttention-2) and memory-efficient backends on
                   q k v [B, H, N, D] views of three contiguous [B, N, H, D] tensors
Each call is a forward and the backward to the q, k, v inputs, 20 captured in one CUDA graph
(microbench.per_call_ms: no host costs, as in a graphed step); output and dq checked against an
fp32 reference (max error relative to the reference's largest value).

Prediction (written before the run): te-packed matches the profile (ViT-L ~0.58 ms a call);
te-separate within 5% of it (the same cuDNN engine); sdpa-cudnn within 10%;
sdpa-flash 1.2-1.6x slower (FlashAttention-2 is not Hopper's kernel), sdpa-efficient 1.5-2x
slower. A path worth building must save >= 10% of te-packed's time (ViT-L >= 1.4 ms a step).

Measured (H100, results/levers/attention_backends_lever50_h100.log): no faster path. ViT-L, ms a
call: te-packed 0.578, te-separate 0.573, sdpa-cudnn 0.573 (on the packed views 0.677: SplitQKV
stacks its gradients), sdpa-flash 0.773, sdpa-efficient 1.227; ViT-H alike. ViT-B's TE paths fail
to capture in this script's plain ``torch.cuda.graph`` (cudaErrorStreamCaptureInvalidated, then
the RNG's offset; at ViT-L and ViT-H they capture; the library captures TE's attention through TE's
own graphing); its sdpa-cudnn 0.436 ms matches the step profile's TE attention (0.43 a call).
"""

import math

import fp8vit  # noqa: F401  imports TE before torch runs a cuDNN kernel
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fp8vit._te import te_module
from fp8vit.blocks.base import SplitQKV
from microbench import max_rel_err, per_call_ms

SHAPES = {  # name: (batch, tokens, heads, head dim, blocks)
    "ViT-B/16": (128, 197, 12, 64, 12),
    "ViT-L/16": (128, 197, 16, 64, 24),
    "ViT-H/16": (128, 197, 16, 80, 32),
}


def reference(q, k, v):
    """fp32 softmax(q k^T / sqrt(D)) v; q, k, v [B, N, H, D] -> [B, N, H*D]."""
    q, k, v = (t.float().transpose(1, 2) for t in (q, k, v))
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return (s.softmax(-1) @ v).transpose(1, 2).flatten(2)


def te_attention(heads, dim):
    attn = te_module("transformer_engine.pytorch").DotProductAttention(
        heads, dim, qkv_format="bshd", attn_mask_type="no_mask")
    return lambda q, k, v: attn(q, k, v)  # [B, N, H*D]


def sdpa(backend):
    def run(q, k, v):  # q, k, v [B, N, H, D] (strided views)
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return o.transpose(1, 2).flatten(2)
    return run


def layouts(qkv):
    """The same q, k, v ([B, N, H, D] values) as each path takes them: (leaves, their q, k, v,
    the leaves' dq). qkv: [B, N, 3, H, D]."""
    packed = qkv.detach().clone().requires_grad_(True)
    separate = [t.detach().clone().contiguous().requires_grad_(True) for t in qkv.unbind(2)]
    return {"packed": ([packed], lambda: SplitQKV.apply(packed), lambda: packed.grad[:, :, 0]),
            "separate": (separate, lambda: separate, lambda: separate[0].grad)}


def main():
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    print(f"{'shape':9s} {'path':17s} {'fwd+bwd ms':>10s} {'per step ms':>11s} {'vs te-packed':>12s}   max err: out, dq (vs fp32)")
    for name, (B, N, H, D, blocks) in SHAPES.items():
        qkv = torch.randn(B, N, 3, H, D, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(B, N, H * D, device="cuda", dtype=torch.bfloat16)
        ref_q = qkv[:, :, 0].detach().float().requires_grad_(True)
        ref_out = reference(ref_q, qkv[:, :, 1], qkv[:, :, 2])
        ref_out.backward(g.float())
        paths = {"te-packed": (te_attention(H, D), "packed"),
                 "te-separate": (te_attention(H, D), "separate"),
                 "sdpa-cudnn-packed": (sdpa(SDPBackend.CUDNN_ATTENTION), "packed"),
                 "sdpa-cudnn": (sdpa(SDPBackend.CUDNN_ATTENTION), "separate"),
                 "sdpa-flash": (sdpa(SDPBackend.FLASH_ATTENTION), "separate"),
                 "sdpa-efficient": (sdpa(SDPBackend.EFFICIENT_ATTENTION), "separate")}
        base = None
        for path, (fn, layout) in paths.items():
            leaves, qkv_of, dq_of = layouts(qkv)[layout]

            def call():
                out = fn(*qkv_of())
                return out, torch.autograd.grad(out, leaves, g)
            try:
                out, grads = call()
                ms = per_call_ms(call)
            except Exception as err:  # a backend that refuses these inputs: say so, go on
                print(f"{name:9s} {path:17s} {'n/a':>10s}   {type(err).__name__}: {str(err)[:150]}")
                continue
            for t, gr in zip(leaves, grads):
                t.grad = gr
            if path == "te-packed":
                base = ms
            errs = (max_rel_err(out.detach(), ref_out.detach()), max_rel_err(dq_of(), ref_q.grad))
            ratio = f"{ms / base:11.2f}x" if base else f"{'n/a':>12s}"  # te-packed failed: nothing to compare to
            print(f"{name:9s} {path:17s} {ms:10.3f} {blocks * ms:11.2f} {ratio}   "
                  + ", ".join(f"{e:.1e}" for e in errs))


if __name__ == "__main__":
    main()
