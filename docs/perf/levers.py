"""Performance levers for fp8vit's FP8 step, measured in one process (docs/performance.md,
levers 1-15).

    python3 docs/perf/levers.py --model huge --batch 128 --variants all --profile te-layer,fp8vit \
        --out $OUT

Each variant is one training step of a timm ViT (SGD momentum, synthetic data, bf16 autocast) timed
as the median of ``--steps`` after ``--warmup``; ratios are only meaningful within one run.
``--profile`` also writes a per-kernel table (name, calls/step, ms/step) for the named variants.

Variants (all under DelayedScaling HYBRID, TE's default history, except timm-bf16):
  timm-bf16          timm blocks, bf16 autocast
  te-layer           a plain te.TransformerLayer configured for a ViT (bshd, no mask, eps 1e-6)
  fp8vit             fp8vit.convert_to_te as shipped in this tree
  fp8vit-res-fp32    fp8vit with the residual stream kept in fp32 (timm's behaviour under autocast)
  fp8vit-qkvlayer    fp8vit with the attention inputs passed as TE's qkv_layer= (TE slices them with
                     select; autograd's select backward zero-fills the packed gradient per view)
  fp8vit-mlp-recompute  fp8vit with TE's selective MLP recompute (LayerNormMLP(checkpoint=True)):
                     the MLP's activations are recomputed in backward instead of saved;
                     fp8vit-mlp-recompute-everyK: only in every K-th block (0, K, 2K, ...)
  *-foreach          the same with foreach SGD instead of fused SGD
  *-cudnn-norm       the same with TE's LayerNorm running on cuDNN's kernels instead of TE's own
                     (fp8vit.set_cudnn_layernorm: TE has no tuned kernel for C = 768, 1024, 1280)
  *-fp8dpa           the same with FP8 attention (DelayedScaling(fp8_dpa=True)): changes numerics
  *-sepgelu          the same with TE's separate GELU+cast kernel after fc1 (TE_Block.gelu_in_gemm =
                     False): fp8vit before lever 12, which put GELU in the fc1 GEMM's epilogue
  *-graphed          the blocks captured with te.make_graphed_callables (TE's defaults: every
                     parameter gradient is copied out of the graph's buffers after each replay)
  *-blockgraphs      the blocks captured with fp8vit.make_graphed_blocks (the gradients are not
                     copied unless a .grad is still set)
  *-bf16wgrad-blockgraphs  the same with make_graphed_blocks(fused_wgrad=False): TE's wgrad GEMMs
                     write bf16 and autograd casts to the fp32 parameters (before lever 15)

``--max-batch`` also finds, per variant, the largest batch (multiple of 8) for which training
steps fit in memory, probing in this process: for eager variants only (it refuses graphed ones;
``max_batch.py`` probes each batch in a new process).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import statistics
import sys

import fp8vit  # imports TE before torch runs a cuDNN kernel
from fp8vit import _te
from fp8vit.tools.profiling import kernel_table, trace_events, trace_kernels
import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer

SIZES = {"base": (768, 12, 12), "large": (1024, 24, 16), "huge": (1280, 32, 16)}


def te_layer_block():
    import transformer_engine.pytorch as te

    class TELayer(te.TransformerLayer):
        def __init__(self, dim, num_heads, mlp_ratio=4.0, qkv_bias=False, proj_drop=0.0, attn_drop=0.0, **kw):
            super().__init__(hidden_size=dim, ffn_hidden_size=int(dim * mlp_ratio), num_attention_heads=num_heads,
                             hidden_dropout=proj_drop, attention_dropout=attn_drop, attn_input_format="bshd",
                             self_attn_mask_type="no_mask", layernorm_epsilon=1e-6)
    return TELayer


def build(variant, size):
    dim, depth, heads = SIZES[size]
    kw = dict(embed_dim=dim, depth=depth, num_heads=heads)
    if variant.startswith("te-layer"):
        return VisionTransformer(block_fn=te_layer_block(), **kw).cuda()
    model = VisionTransformer(**kw).cuda()
    if variant.startswith("fp8vit"):
        fp8vit.convert_to_te(model)
        if "res-fp32" in variant:
            for b in model.blocks:
                b.fp32_residual = True
        if "mlp-recompute" in variant:  # TE's selective recompute of fc1 + activation in backward
            every = int(re.search(r"-every(\d+)", variant).group(1)) if "-every" in variant else 1
            fp8vit.set_mlp_recompute(model, every=every)
        if "sepgelu" in variant:  # TE's GELU+cast kernel instead of the fc1 GEMM's epilogue
            for b in model.blocks:
                b.gelu_in_gemm = False
        if "qkvlayer" in variant:
            import types
            for b in model.blocks:
                b._attention = types.MethodType(_attention_qkv_layer, b)
    return model


def _attention_qkv_layer(self, x, attn_mask, is_causal, mult):
    """TE_Block._attention before lever 2: the packed buffer handed to TE as qkv_layer."""
    from fp8vit.blocks.base import aligned_rows
    B, N, _ = x.shape
    qkv = aligned_rows(self.qkv, x, mult).view(B, N, 3, self.cfg.num_heads, self.cfg.head_dim)
    o = self.attn(qkv_layer=qkv, qkv_interleave_dim=-3)
    return self.proj_drop(aligned_rows(self.proj, o, mult))


def make_step(variant, model):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, fused="foreach" not in variant,
                          foreach=True if "foreach" in variant else None)
    fp8 = not variant.startswith("timm")
    recipe = fp8vit.make_recipe("delayed") if fp8 else None
    if "fp8dpa" in variant:
        rm = _te.te_module("transformer_engine.common.recipe")
        recipe = rm.DelayedScaling(fp8_format=rm.Format.HYBRID, fp8_dpa=True)

    def step(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            with _te.autocast(enabled=True, recipe=recipe) if fp8 else contextlib.nullcontext():
                out = model(x)
            loss = F.cross_entropy(out.float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def graph_blocks(model, batch, dim):
    """Capture model.blocks with te.make_graphed_callables (as ../shared/reference/graphs_probe.py)."""
    import transformer_engine.pytorch as te
    sample = (torch.randn(batch, 197, dim, device="cuda", requires_grad=True),)
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        model.blocks = te.make_graphed_callables(model.blocks, sample, enabled=True,
                                                 recipe=fp8vit.make_recipe("delayed"),
                                                 cache_quantized_params=False)


def time_variant(variant, size, batch, steps, warmup, profile):
    with _te.cudnn_norm(True) if "cudnn-norm" in variant else contextlib.nullcontext():
        return _time_variant(variant, size, batch, steps, warmup, profile)


def _time_variant(variant, size, batch, steps, warmup, profile):
    torch.manual_seed(0)
    # Before the build: a graphed variant's activations live in the graph pool, allocated at capture.
    torch.cuda.reset_peak_memory_stats()
    model = build(variant, size).train()
    graphs = None
    if "blockgraphs" in variant:  # the product's path (parameter gradients leave the graph uncopied)
        graphs = fp8vit.make_graphed_blocks(model, batch, cudnn_layernorm="cudnn-norm" in variant,
                                            fused_wgrad="bf16wgrad" not in variant)
    elif "graphed" in variant:  # TE's make_graphed_callables as a user would call it (gradients copied)
        graph_blocks(model, batch, SIZES[size][0])
    built_gib = torch.cuda.memory_allocated() / 2**30  # weights (+ graphs' buffers) before any step
    step = make_step(variant, model)
    x = torch.randn(batch, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (batch,), device="cuda")
    for _ in range(warmup):
        step(x, y)
    torch.cuda.synchronize()
    build_peak_gib = torch.cuda.max_memory_allocated() / 2**30  # build, capture and warm-up
    torch.cuda.reset_peak_memory_stats()  # from here: the steady state of a training step
    ev = []
    for _ in range(steps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); loss = step(x, y); e.record(); ev.append((s, e))
    torch.cuda.synchronize()
    ms = sorted(s.elapsed_time(e) for s, e in ev)
    step_peak_gib = torch.cuda.max_memory_allocated() / 2**30
    r = {"variant": variant, "model": size, "batch": batch, "median_ms": statistics.median(ms),
         "p10_ms": ms[len(ms) // 10], "p90_ms": ms[-1 - len(ms) // 10], "loss": float(loss),
         "peak_gib": max(build_peak_gib, step_peak_gib), "step_peak_gib": step_peak_gib,
         "built_gib": built_gib}
    if profile:
        from torch.profiler import ProfilerActivity, profile as prof_ctx
        n = 3
        with prof_ctx(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                step(x, y)
            torch.cuda.synchronize()
        rows = kernel_table([(name, "", us) for name, _, us in trace_kernels(trace_events(prof))], n)  # graphs included
        r["kernels"] = [[k, calls, ms] for k, _, calls, ms in rows]
        r["kernel_ms"] = sum(t[2] for t in r["kernels"])
    if graphs is not None:
        graphs.release()  # otherwise the graph pool outlives the model and the next probe sees less memory
    del model, step, x, y, graphs
    gc.collect(); torch.cuda.empty_cache()
    r["left_gib"] = torch.cuda.memory_allocated() / 2**30  # still allocated after the variant is gone
    return r


def fits_in_memory(run) -> bool:
    """Whether ``run()`` completes without a CUDA out-of-memory error; memory is freed either way."""
    try:
        run()
        ok = True
    except torch.OutOfMemoryError:
        ok = False
    # Outside the except block: the traceback (and the failed run's tensors in its frames) is gone.
    gc.collect()
    torch.cuda.empty_cache()
    return ok


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="huge", choices=sorted(SIZES))
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--variants", default="all")
    p.add_argument("--profile", default="")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--max-batch", action="store_true")
    a = p.parse_args()
    if a.max_batch and "graph" in a.variants:
        # After one graphed run, the same batch no longer fits in the same process (lever 14).
        p.error("--max-batch probes in this process, which is not valid after a CUDA-graphed variant: "
                "use docs/perf/max_batch.py (a new process per probe) for those")
    names = (["timm-bf16", "te-layer", "te-layer-foreach", "fp8vit", "fp8vit-foreach", "fp8vit-res-fp32"]
             if a.variants == "all" else a.variants.split(","))
    prof = set(filter(None, a.profile.split(",")))
    rows = []
    for v in names:
        try:
            r = time_variant(v, a.model, a.batch, a.steps, a.warmup, v in prof)
        except Exception as e:  # one unsupported lever must not end the run; it is reported instead
            print(f"{a.model} b{a.batch} {v:22s} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
            gc.collect(); torch.cuda.empty_cache()
            continue
        rows.append(r)
        print(f"{a.model} b{a.batch} {v:22s} {r['median_ms']:8.1f} ms  (p10 {r['p10_ms']:.1f}, p90 {r['p90_ms']:.1f})"
              f"  peak {r['peak_gib']:.1f} GiB (steps {r['step_peak_gib']:.1f}, built {r['built_gib']:.1f}, left {r['left_gib']:.2f})" + (f"  kernels {r['kernel_ms']:.1f} ms" if "kernel_ms" in r else ""),
              flush=True)
    if a.max_batch:
        from fp8vit.tools.bench import largest_fitting
        for r in rows:
            def fits(b, v=r["variant"]):
                ok = fits_in_memory(lambda: time_variant(v, a.model, b, 1, 1, False))
                # What a probe leaves behind would shrink the next one: printed so that it shows.
                free, total = torch.cuda.mem_get_info()
                print(f"  probe {v} b{b}: {'fits' if ok else 'OOM'}; after it "
                      f"{torch.cuda.memory_reserved() / 2**30:.1f} GiB reserved by torch, "
                      f"{(total - free) / 2**30:.1f} GiB in use on the device", flush=True)
                return ok
            r["max_batch"] = largest_fitting(fits, a.batch)
            print(f"{a.model} {r['variant']:22s} max batch {r['max_batch']}", flush=True)
    base = next((r["median_ms"] for r in rows if r["variant"] == "te-layer"), None)
    if base:
        for r in rows:
            print(f"  {r['variant']:22s} / te-layer = {r['median_ms'] / base:.3f}")
    with open(os.path.join(a.out, f"levers_{a.model}_{a.batch}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    for r in rows:
        if "kernels" in r:
            with open(os.path.join(a.out, f"kernels_{r['variant']}_{a.model}_{a.batch}.txt"), "w") as f:
                f.write(f"# {r['variant']} {a.model} b{a.batch}: {r['kernel_ms']:.2f} ms kernel time/step\n")
                f.write(f"{'ms/step':>9s} {'calls':>7s}  kernel\n")
                for name, calls, ms in r["kernels"]:
                    f.write(f"{ms:9.3f} {calls:7.1f}  {name[:160]}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
