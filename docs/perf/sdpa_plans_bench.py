"""Lever 66's microbenchmark: every cuDNN SDPA execution plan for the classic ViT's attention against
the heuristic's first, the one TE runs (lever 50, ``attention_backends.py``, compared kernel paths
and layouts; this compares the plans of the one TE takes).

    python3 docs/perf/sdpa_plans_bench.py [--modes A,FALLBACK]   # on the GPU machine, TE installed

The same attention as ``attention_backends.py``'s te-packed path (its shapes, batch 128, 197 tokens,
no mask, scale 1/sqrt(D)), built with the cuDNN frontend's Python API (``cudnn``, TE's requirement
nvidia-cudnn-frontend): a training forward (O and the softmax stats) and a backward (dQ, dK, dV
into one packed buffer), q k v views of the packed [B, N, 3, H, D] qkv GEMM output. Each plan the
heuristic modes list is built and timed alone (``microbench.per_call_ms``: 20 calls in a CUDA graph,
no host costs), its O or dQ checked against fp32 (``max_rel_err``); a plan over 3x plan 0's error
is WRONG and never the fastest. The backward plans run on plan 0's forward outputs. te-packed's
forward + backward beside them: plan 0's two should add up to about it.

Prediction (written before the run): another plan 0-10% faster in the backward (ViT-L: 7.8 ms of
bprop, 1.8 of dO.O, 1.5 of dQ conversion a step), 0 to -1.1 ms a ViT-L step. Using one means fp8vit
calling cuDNN itself: worth building at >= 0.5 ms a step.
"""

import argparse
import math

import fp8vit  # noqa: F401  imports TE before torch runs a cuDNN kernel
import cudnn  # the cuDNN frontend TE requires
import torch

from attention_backends import SHAPES, layouts, reference, te_attention
from microbench import max_rel_err, per_call_ms

WRONG_FACTOR = 3.0  # a plan whose error is over this many times plan 0's is WRONG


def _graph(handle):
    """bf16 in and out, fp32 intermediates and compute, as TE's fused attention builds it."""
    f32 = cudnn.data_type.FLOAT
    return cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16, intermediate_data_type=f32,
                         compute_data_type=f32, handle=handle)


def _bind(graph, tensors, outputs):
    """Graph tensors for ``tensors`` (name -> torch tensor, cuDNN's (B, H, N, D) dims and the views'
    own strides) and for ``outputs`` (graph tensor -> its torch buffer); the variant pack."""
    def dtype(t):
        return cudnn.data_type.FLOAT if t.dtype == torch.float32 else cudnn.data_type.BFLOAT16
    pack = {graph.tensor(name=n, dim=list(t.shape), stride=list(t.stride()), data_type=dtype(t)): t
            for n, t in tensors.items()}
    for gt, t in outputs.items():
        gt.set_output(True).set_dim(list(t.shape)).set_stride(list(t.stride())).set_data_type(dtype(t))
        pack[gt] = t
    return pack


def _refused(label, err):
    print(f"  {label}: {type(err).__name__}: {' '.join(str(err).split())[:150]}")


def built_plans(graph, modes, label):
    """The indices of the plans of ``graph`` that build (each failure printed), heuristic's order."""
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans(modes)
    graph.check_support()
    built = []
    for i in range(graph.get_execution_plan_count()):
        try:
            graph.build_plan_at_index(i)
            built.append(i)
        except Exception as err:  # a plan the engine declines here: say so, go on
            _refused(f"{label} plan {i} not built", err)
    return built


def execute(graph, pack, i, handle):
    """Enqueue plan ``i`` of ``graph`` on the stream torch runs now (per_call_ms captures on a side
    stream: the handle follows it each call)."""
    ws = torch.empty(graph.get_workspace_size_plan_at_index(i), dtype=torch.uint8, device="cuda")
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    graph.execute_plan_at_index(pack, ws, index=i, handle=handle)


def time_plans(label, graph, plans, pack, handle, check):
    """Per plan that runs: (index, ms a call, error of ``check()`` after it ran)."""
    rows = []
    for i in plans:
        def call(i=i):
            execute(graph, pack, i, handle)
        try:
            call()  # the outputs are plan i's
            err = check()
            rows.append((i, per_call_ms(call), err))
        except Exception as err:  # built, but it does not run here (or in a capture): say so, go on
            _refused(f"{label} plan {i} did not run", err)
    return rows


def report(label, rows, blocks, name):
    """One line a plan (``*`` plan 0), then the fastest correct plan against plan 0."""
    first = rows[0] if rows and rows[0][0] == 0 else None
    limit = WRONG_FACTOR * first[2] if first else math.inf
    for i, ms, err in rows:
        print(f"  {label} plan {i:2d}{'*' if i == 0 else ' '} {ms * 1e3:8.1f} us  err {err:.1e}"
              f"{'  WRONG' if not err <= limit else ''}  {name(i)}")
    good = [r for r in rows if r[2] <= limit]
    if first and good:
        best = min(good, key=lambda r: r[1])
        saved = first[1] - best[1]
        print(f"  {label}: fastest correct plan {best[0]} against plan 0: {saved * 1e3:.1f} us a call, "
              f"{saved * blocks:.2f} ms a step ({blocks} blocks)")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="A,FALLBACK", help="cuDNN heuristic modes, comma-separated")
    args = p.parse_args()
    modes = [getattr(cudnn.heur_mode, m) for m in args.modes.split(",")]
    handle = cudnn.create_handle()
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"cudnn-frontend {cudnn.__version__}, modes {args.modes}")
    for shape, (B, N, H, D, blocks) in SHAPES.items():
        print(shape)
        qkv = torch.randn(B, N, 3, H, D, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(B, N, H * D, device="cuda", dtype=torch.bfloat16)  # dO
        ref_q = qkv[:, :, 0].detach().float().requires_grad_(True)
        ref_out = reference(ref_q, qkv[:, :, 1], qkv[:, :, 2])  # [B, N, H*D] fp32
        ref_out.backward(g.float())
        bhnd = lambda t: t.permute(0, 2, 1, 3)  # noqa: E731  [B, N, H, D] view -> cuDNN's (B, H, N, D)
        q, k, v = (bhnd(t) for t in qkv.unbind(2))
        o = torch.empty(B, N, H, D, device="cuda", dtype=torch.bfloat16)
        stats = torch.empty(B, H, N, 1, device="cuda", dtype=torch.float32)
        dqkv = torch.empty_like(qkv)  # dq dk dv packed, as TE writes them for fp8vit
        scale = 1 / math.sqrt(D)

        fwd = _graph(handle)
        fpack = _bind(fwd, {"q": q, "k": k, "v": v}, {})
        gq, gk, gv = fpack
        go, gstats = fwd.sdpa(name="sdpa", q=gq, k=gk, v=gv, is_inference=False, attn_scale=scale)
        fpack.update(_bind(fwd, {}, {go: bhnd(o), gstats: stats}))
        bwd = _graph(handle)
        bpack = _bind(bwd, {"q": q, "k": k, "v": v, "o": bhnd(o), "do": bhnd(g.view(B, N, H, D)),
                            "stats": stats}, {})
        bq, bk, bv, bo, bdo, bstats = bpack
        dq, dk, dv = bwd.sdpa_backward(name="sdpa_backward", q=bq, k=bk, v=bv, o=bo, dO=bdo, stats=bstats,
                                       attn_scale=scale)
        bpack.update(_bind(bwd, {}, {gt: bhnd(t) for gt, t in zip((dq, dk, dv), dqkv.unbind(2))}))

        frows = time_plans("fwd", fwd, built_plans(fwd, modes, "fwd"), fpack, handle,
                           lambda: max_rel_err(o.flatten(2), ref_out.detach()))
        report("fwd", frows, blocks, fwd.get_plan_name_at_index)
        if not frows or frows[0][0] != 0:
            print("  plan 0's forward did not run: no backward (it reads plan 0's O and stats)")
            continue
        execute(fwd, fpack, 0, handle)  # O and stats as plan 0 writes them
        brows = time_plans("bwd", bwd, built_plans(bwd, modes, "bwd"), bpack, handle,
                           lambda: max_rel_err(dqkv[:, :, 0], ref_q.grad))
        report("bwd", brows, blocks, bwd.get_plan_name_at_index)
        leaves, qkv_of, _ = layouts(qkv)["packed"]
        attn = te_attention(H, D)

        def te_call():
            out = attn(*qkv_of())
            torch.autograd.grad(out, leaves, g)
        try:
            te_call()
            te_ms = per_call_ms(te_call)
        except Exception as err:  # ViT-B's TE path does not capture in a plain torch.cuda.graph (lever 50)
            _refused("te-packed", err)
            continue
        plan0 = (frows[0][1] + brows[0][1]) * 1e3 if brows and brows[0][0] == 0 else math.nan
        print(f"  te-packed forward + backward {te_ms * 1e3:.1f} us a call; plan 0's two {plan0:.1f} us")


if __name__ == "__main__":
    main()
